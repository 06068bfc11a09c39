"""The deployment secret and the MAC every frame carries (common/wire_auth.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from pdserve.common.wire_auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    TAG_BYTES,
    Sealer,
    SecretError,
    deployment_secret,
    ensure_secret,
)


def test_a_sealed_frame_opens_and_any_change_is_refused(caplog) -> None:
    sealer = Sealer(b"s3cret", name="i-0")
    frame = sealer.seal(b"payload")
    assert len(frame) == TAG_BYTES + len(b"payload")
    assert sealer.open(frame) == b"payload"
    flipped = frame[:-1] + bytes([frame[-1] ^ 1])
    with caplog.at_level(logging.WARNING):
        assert sealer.open(flipped, "tcp://10.0.0.9") is None
        assert sealer.open(b"payload") is None  # no MAC at all
        assert Sealer(b"other").open(frame) is None  # another deployment's
    assert sealer.refused == 2
    assert "i-0: refused a message from tcp://10.0.0.9" in caplog.text


def test_multipart_tags_bind_each_part_and_its_length() -> None:
    sealer = Sealer(b"k")
    tag = sealer.tag_parts(b"topic", b"body")
    assert sealer.check_parts(tag, b"topic", b"body")
    assert not sealer.check_parts(tag, b"topi", b"cbody")  # same bytes, other split
    assert not sealer.check_parts(tag[:-1], b"topic", b"body")


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
