"""Safe by default: `pdserve serve` beyond loopback needs tenant keys and an admin key
(or `--allow-unauthenticated`), refused in one line before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.cli import build_parser
from pdserve.cluster.exposure import ExposureError, check_exposure, is_loopback

KEYS_ENV = {"PDSERVE_API_KEY": "tenant-key", "PDSERVE_ADMIN_API_KEY": "admin-key"}


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "192.168.0.7", "fe80::1"])
def test_hosts_beyond_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_loopback_needs_no_keys() -> None:
    check_exposure(parse(), environ={})
    check_exposure(parse("--host", "localhost"), environ={})


@pytest.mark.parametrize(
    ("argv", "environ", "missing"),
    [
        ([], {}, ["--api-key", "--admin-api-key"]),
        (["--api-key", "k"], {}, ["--admin-api-key"]),
        (["--admin-api-key", "a"], {}, ["--api-key, --api-keys-file or PDSERVE_API_KEY"]),
        ([], {"PDSERVE_ADMIN_API_KEY": "a"}, ["--api-key"]),
        ([], {"PDSERVE_API_KEY": "k"}, ["PDSERVE_ADMIN_API_KEY"]),
    ],
)
def test_beyond_loopback_without_both_keys_is_refused(
    argv: list[str], environ: dict[str, str], missing: list[str]
) -> None:
    with pytest.raises(ExposureError) as refused:
        check_exposure(parse("--host", "0.0.0.0", *argv), environ=environ)
    message = str(refused.value)
    assert "\n" not in message and "--allow-unauthenticated" in message
    for name in missing:
        assert name in message


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--api-key", "k", "--admin-api-key", "a"], {}),
        (["--api-keys-file", "keys.json", "--admin-api-key", "a"], {}),
        ([], KEYS_ENV),
        (["--allow-unauthenticated"], {}),
    ],
)
def test_beyond_loopback_with_keys_or_the_opt_out_passes(
    argv: list[str], environ: dict[str, str]
) -> None:
    check_exposure(parse("--host", "0.0.0.0", *argv), environ=environ)


def test_the_cli_refuses_in_one_line_within_seconds() -> None:
    env = {k: v for k, v in os.environ.items() if k not in KEYS_ENV}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve serve: error: --host 0.0.0.0")
    assert "--admin-api-key" in lines[0] and "--api-keys-file" in lines[0]
    assert done.stdout == ""
    assert elapsed < 10, elapsed
