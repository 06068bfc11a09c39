"""Models by name: a folder as it is, a Hugging Face id from a local hub cache laid out
here (offline: nothing may reach a hub), and one-line errors for what is not found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.engine.model_source import ModelNotFound, resolve_model


def lay_out_hub_cache(cache: Path, repo_id: str, revisions: dict[str, str]) -> dict[str, Path]:
    """A hub cache as huggingface_hub writes it: refs/<revision> name a commit whose
    snapshot folder holds the files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshots = {}
    for index, (revision, commit) in enumerate(revisions.items()):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps({"marker": index}))
        snapshots[revision] = snapshot
    return snapshots


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_folder_is_the_model(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelNotFound, match="--revision"):
        resolve_model(str(tmp_path), revision="v1")


def test_a_hugging_face_id_resolves_from_the_cache_offline(tmp_path: Path) -> None:
    snapshots = lay_out_hub_cache(tmp_path, "acme/tiny", {"main": "a" * 40, "v1": "b" * 40})
    found = resolve_model("acme/tiny", download_dir=str(tmp_path))
    assert found == snapshots["main"] and (found / "config.json").is_file()
    assert resolve_model("acme/tiny", "v1", str(tmp_path)) == snapshots["v1"]


def test_what_is_not_found_is_one_line_saying_where_it_looked(tmp_path: Path) -> None:
    lay_out_hub_cache(tmp_path, "acme/tiny", {"main": "a" * 40})
    for name, revision in (("acme/missing", None), ("acme/tiny", "v9")):
        with pytest.raises(ModelNotFound) as error:
            resolve_model(name, revision, str(tmp_path))
        message = str(error.value)
        assert "\n" not in message and name in message and str(tmp_path) in message
        assert "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelNotFound, match="no such checkpoint folder"):
        resolve_model(str(tmp_path / "nope" / "deeper" / "x"))
