"""Test servers that run as `python -m MODULE`, bind 127.0.0.1 on a free port and print
it on their first line (the scripted OpenAI server, the eval's table server): how they
serve and how their tests start them, and the `refused_url` fixture those tests share."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def printed_port_server(module: str, ready_path: str) -> Iterator[str]:
    """Starts `python -m module`, yields its base URL once `GET ready_path` answers 2xx,
    and ends the process on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        base_url = f"http://127.0.0.1:{int(proc.stdout.readline().strip())}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{base_url}{ready_path}", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"{module} did not come up")
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def refused_url() -> str:
    """A 127.0.0.1 address where nothing listens (a fixture: conftests import it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def serve_printing_port(app: Any, port: int = 0) -> None:
    """Serves the ASGI `app` on 127.0.0.1:`port` (0: a free one) until terminated,
    printing the port first, as `printed_port_server` reads it."""
    import uvicorn

    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on sockets that say they are
    # TCP; without it Nagle's algorithm and delayed ACKs add ~40 ms to small replies.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
