from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


class ScriptedServer:
    """Handle on the scripted server subprocess: set its script, read its counters."""

    def __init__(self, port: int) -> None:
        self.base_url = f"http://127.0.0.1:{port}"

    def script(self, **settings: object) -> None:
        httpx.post(f"{self.base_url}/script", json=settings, timeout=5).raise_for_status()

    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/stats", timeout=5).json()


@pytest.fixture(scope="session")
def scripted_server() -> Iterator[ScriptedServer]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.scripted_server"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().strip())
        server = ScriptedServer(port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{server.base_url}/v1/models", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("scripted server did not come up")
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
