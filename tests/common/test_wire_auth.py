"""The deployment secret and the keys derived from it (common/wire_auth.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.common.wire_auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SecretError,
    deployment_secret,
    ensure_secret,
    frame_key,
    rendezvous_prefix,
    salt_key,
)


def test_each_purpose_gets_a_key_of_its_own() -> None:
    """Frames, cache salts and rendezvous keys never share a key, nor use the secret."""
    keys = {frame_key(b"s"), salt_key(b"s"), b"s"}
    assert len(keys) == 3 and all(len(k) == 32 for k in keys - {b"s"})
    assert frame_key(b"s") == frame_key(b"s") != frame_key(b"t")
    assert rendezvous_prefix(b"s", "10.0.0.1:5") != rendezvous_prefix(b"s", "10.0.0.1:6")
    assert rendezvous_prefix(b"s", "h:1") != rendezvous_prefix(b"t", "h:1")


def test_the_secret_comes_from_the_environment_or_a_private_file(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    os.chmod(path, 0o600)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert deployment_secret() == b"from-a-file"
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="readable by others; chmod 600"):
        deployment_secret()
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert deployment_secret() == b"from-env"  # the variable wins


def test_a_process_without_one_makes_one_its_children_inherit(monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    made = ensure_secret()
    assert len(made) == 64 and os.environ[SECRET_ENV] == made
    assert ensure_secret() == made and deployment_secret() == made.encode()
