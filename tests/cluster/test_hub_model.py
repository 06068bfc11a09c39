"""`pdserve serve ORG/NAME`: a Hugging Face id resolved from a hub cache laid out here
(HF_HUB_OFFLINE=1: nothing reaches a hub), served under its id; a wrong id is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.serving import ServeProcess
from pdserve.engine.embedded import embedded_model_path

pytestmark = pytest.mark.slow

REPO_ID = "acme/smollm2-mirror"
COMMIT = "c" * 40
OFFLINE = {"HF_HUB_OFFLINE": "1"}


def hub_cache_of_the_embedded_model(cache: Path) -> Path:
    """refs/main → a snapshot whose files link to the embedded checkpoint's."""
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in embedded_model_path().iterdir():
        (snapshot / file.name).symlink_to(file)
    return cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hub_cache_of_the_embedded_model(tmp_path_factory.mktemp("hub"))


@pytest.fixture(scope="module")
def server(cache: Path) -> Iterator[ServeProcess]:
    process = ServeProcess.start(
        REPO_ID, "--download-dir", str(cache), "--mode", "colocated", "--num-colocated", "1",
        "--launcher", "local", "--dtype", "float32", "--kv-cache-memory", "64MiB",
        "--max-model-len", "512", "--threads-per-instance", "1", env=OFFLINE,
    )  # fmt: skip
    try:
        yield process
    finally:
        process.stop()


def test_a_hub_id_is_served_under_its_name(server) -> None:
    client = server.openai()
    assert [m.id for m in client.models.list().data] == [REPO_ID]
    result = client.completions.create(
        model=REPO_ID, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert result.choices[0].text.startswith(" Paris")


def test_a_wrong_id_is_one_line_naming_the_cache(cache: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "acme/no-such-model",
         "--download-dir", str(cache), "--mode", "colocated", "--port", "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE},
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "acme/no-such-model" in lines[0] and str(cache) in lines[0], lines[0]
