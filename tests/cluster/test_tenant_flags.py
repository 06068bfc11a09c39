"""`pdserve serve`'s key flags: `--api-keys-file` is read and checked before anything
starts, and each problem of the file is one line naming it; `--api-key` falls back to
PDSERVE_API_KEY; the deployment secret comes from the environment only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import build_parser, main
from pdserve.cluster.deployment import Deployment, ServeError
from pdserve.cluster.serve import deployment_secret
from pdserve.gateway.tenants import KeyBook


def plan_of(*argv: str) -> Deployment:
    return Deployment.from_args(build_parser().parse_args(["serve", *argv]), cores=[0, 1])


def write(tmp_path: Path, content: object) -> str:
    path = tmp_path / "keys.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


GOOD = {
    "tenants": [
        {"name": "a", "keys": ["a-1", "a-2"], "requests_per_minute": 60, "models": ["m"]},
        {"name": "b", "keys": ["b-1"], "max_tokens_per_request": 100},
    ]
}


def test_a_keys_file_becomes_tenants(tmp_path: Path) -> None:
    plan = plan_of("--served-model-name", "m", "--api-keys-file", write(tmp_path, GOOD))
    assert plan.api_keys is not None and plan.api_key is None
    book = KeyBook.build(plan.served_model_names, plan.api_keys)
    assert [t.name for t in book.tenants] == ["a", "b"]
    a = book.tenant_for("a-2")
    assert a is not None and a.requests_per_minute == 60 and a.models == frozenset({"m"})
    assert book.tenant_for("b-1").max_tokens_per_request == 100
    assert book.tenant_for("c") is None
    assert "a-1" not in repr(plan) and "a-1" not in repr(book)


BAD = [
    ("{", "--api-keys-file"),
    ({"tenants": []}, "tenants"),
    ({"tenants": [{"name": "a"}]}, "keys"),
    ({"tenants": [{"name": "a", "keys": []}]}, "keys"),
    ({"tenants": [{"name": "a b", "keys": ["k"]}]}, "name"),
    ({"tenants": [{"name": "a", "keys": ["k"], "requests_per_minute": 0}]}, "requests_per_minute"),
    ({"tenants": [{"name": "a", "keys": ["k"], "rpm": 5}]}, "rpm"),
    ({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "a", "keys": ["j"]}]}, "named twice"),
    ({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "b", "keys": ["k"]}]}, "given twice"),
    ({"tenants": [{"name": "a", "keys": ["k"], "models": ["other"]}]}, "'other' is not served"),
]


@pytest.mark.parametrize(("content", "named"), BAD)
def test_a_bad_keys_file_is_one_line(tmp_path: Path, content: object, named: str) -> None:
    with pytest.raises(ServeError) as error:
        plan_of("--served-model-name", "m", "--api-keys-file", write(tmp_path, content))
    assert named in str(error.value) and "\n" not in str(error.value)


def test_key_flags_that_contradict_each_other_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = write(tmp_path, GOOD)
    with pytest.raises(ServeError, match="either --api-keys-file or --api-key"):
        plan_of("--api-keys-file", keys, "--api-key", "k")
    with pytest.raises(ServeError, match="admin key is also a tenant's key"):
        plan_of("--served-model-name", "m", "--api-keys-file", keys, "--admin-api-key", "b-1")
    with pytest.raises(ServeError, match="No such file"):
        plan_of("--api-keys-file", str(tmp_path / "missing.json"))
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", "admin-from-env")
    assert (plan_of().api_key, plan_of().admin_api_key) == ("from-env", "admin-from-env")
    assert plan_of("--api-key", "flag").api_key == "flag"
    with pytest.raises(ServeError, match="PDSERVE_API_KEY"):
        plan_of("--served-model-name", "m", "--api-keys-file", keys)


def test_serve_says_a_bad_keys_file_in_one_line(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--api-keys-file", write(tmp_path, {"tenants": [{}]})]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdserve serve: error: --api-keys-file") and "\n" not in err


def test_the_deployment_secret_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_DEPLOYMENT_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_DEPLOYMENT_SECRET_FILE", raising=False)
    drawn = deployment_secret()  # none set: one is drawn for this run, and kept
    assert len(drawn) >= 32 and deployment_secret() == drawn
    monkeypatch.setenv("PDSERVE_DEPLOYMENT_SECRET", "s3cret")
    assert deployment_secret() == b"s3cret"
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--api-keys-file" in help_text and "deployment-secret" not in help_text
