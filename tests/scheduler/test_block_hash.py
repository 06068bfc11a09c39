"""Block hashes: chained, salted, stable across processes, and torch-free."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from pdserve.scheduler.block_hash import extra_keys_for, hash_block, hash_full_blocks

REPO = Path(__file__).resolve().parents[2]


def test_hash_is_sha256_of_the_msgpack_encoding() -> None:
    parent = hash_block(None, [1, 2, 3, 4])
    expected = hashlib.sha256(msgspec.msgpack.encode((parent, [5, 6, 7, 8], ("acme",))))
    assert hash_block(parent, [5, 6, 7, 8], ("acme",)) == expected.digest()
    assert len(parent) == 32


def test_hashes_chain_the_parent() -> None:
    a = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    b = hash_full_blocks([9, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert a[0] != b[0]
    assert a[1] != b[1], "same tokens after a different prefix must hash differently"
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])


def test_partial_trailing_block_has_no_hash() -> None:
    assert len(hash_full_blocks(list(range(11)), block_size=4)) == 2
    assert hash_full_blocks([1, 2, 3], block_size=4) == []


def test_salt_separates_tenants() -> None:
    tokens = list(range(32))
    plain = hash_full_blocks(tokens, 16, extra_keys_for(""))
    acme = hash_full_blocks(tokens, 16, extra_keys_for("acme"))
    other = hash_full_blocks(tokens, 16, extra_keys_for("other"))
    assert not set(plain) & set(acme)
    assert not set(acme) & set(other)
    assert acme == hash_full_blocks(tokens, 16, extra_keys_for("acme"))


def _run_without_torch(code: str) -> str:
    prelude = "import sys; sys.modules['torch'] = None\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_hashes_are_identical_in_another_process() -> None:
    tokens = [7, 3, 99, 12000, 5] * 10
    here = [h.hex() for h in hash_full_blocks(tokens, 16, extra_keys_for("tenant-a"))]
    code = (
        "from scheduler.block_hash import hash_full_blocks, extra_keys_for\n"
        f"print(','.join(h.hex() for h in hash_full_blocks({tokens!r}, 16, "
        "extra_keys_for('tenant-a'))))"
    )
    assert _run_without_torch(code).split(",") == here


def test_scheduler_modules_import_without_torch() -> None:
    modules = ["step_scheduler", "block_manager", "block_pool", "config"]
    code = "\n".join(f"import scheduler.{m}" for m in modules) + "\nprint(sys.modules['torch'])"
    assert _run_without_torch(code) == "None"  # imported, and nothing brought torch back


def test_torch_is_unimportable_in_these_tests() -> None:
    with pytest.raises(ImportError):
        import torch  # noqa: F401
