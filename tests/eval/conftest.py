"""The eval room runs without torch (unimportable here), against a fake server of tables."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.no_torch import _no_torch, pytest_make_collect_report  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


class TableServer:
    """Handle on the table server subprocess: one fake OpenAI server per table name."""

    def __init__(self, port: int) -> None:
        self.root = f"http://127.0.0.1:{port}"

    def serve(self, name: str, replies: dict[str, str], default: str = "", **more) -> str:
        """Set table `name`; returns its OpenAI base URL."""
        table = {"replies": replies, "default": default, **more}
        httpx.put(f"{self.root}/tables/{name}", json=table, timeout=5).raise_for_status()
        return f"{self.root}/{name}"

    def requests(self, name: str) -> list[dict]:
        return httpx.get(f"{self.root}/tables/{name}/requests", timeout=5).json()


@pytest.fixture(scope="session")
def table_server() -> Iterator[TableServer]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.eval.table_server"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        server = TableServer(int(proc.stdout.readline().strip()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{server.root}/tables/none/requests", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("table server did not come up")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def refused_url() -> str:
    """A 127.0.0.1 address where nothing listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"
