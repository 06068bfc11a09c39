"""The deployment secret reaches Ray actors as a private file on their node
(cluster/secret_file.py): what Ray's state API shows of an actor (`ray list actors
--detail`: its runtime_env among the rest) names the file, never the secret."""

from __future__ import annotations

import os
import stat

import pytest

from pdserve.cluster import secret_file
from pdserve.common.wire_auth import SECRET_ENV, SECRET_FILE_ENV, SecretError, read_secret_file
from tests.cluster.conftest import ray_list


class Reader:
    """An actor that says where its secret is and what the file holds."""

    def read(self) -> tuple[str, bytes]:
        path = os.environ[SECRET_FILE_ENV]
        return path, read_secret_file(path)


def test_an_actor_reads_the_secret_from_its_file_and_ray_never_shows_it(
    ray_cluster, monkeypatch
) -> None:
    ray = pytest.importorskip("ray")
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, "a-secret-nobody-may-list-" + "7" * 20)
    monkeypatch.setattr(secret_file, "_written", {})
    env = secret_file.secret_runtime_env()
    path = env["env_vars"][SECRET_FILE_ENV]
    assert env == {"env_vars": {SECRET_FILE_ENV: path}}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    reader = ray.remote(Reader).options(name="secret-reader", runtime_env=env).remote()
    try:
        assert ray.get(reader.read.remote(), timeout=120) == (path, os.environ[SECRET_ENV].encode())
        listed = ray_list("actors", ray_cluster)
        assert any(a.get("name") == "secret-reader" for a in listed)
        assert path in repr(listed)  # the runtime_env is shown: the path, never more
        assert os.environ[SECRET_ENV] not in repr(listed)
    finally:
        ray.kill(reader)


def test_the_operators_file_is_named_as_it_is_and_checked_first(tmp_path, monkeypatch) -> None:
    path = tmp_path / "secret"
    path.write_text("from-the-operator\n")
    os.chmod(path, 0o644)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    with pytest.raises(SecretError, match="readable by others"):
        secret_file.secret_runtime_env()
    os.chmod(path, 0o600)
    assert secret_file.secret_runtime_env() == {"env_vars": {SECRET_FILE_ENV: str(path)}}
