"""`pdserve serve` processes for the slow end-to-end modules, one per module."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.gateway.server import ServeProcess

MODEL = "SmolLM2-135M-Instruct"  # the embedded model, what a server with no --model serves
# Local processes, one torch thread each (the machine is shared), test hooks on.
LOCAL = ("--launcher", "local", "--threads-per-instance", "1", "--enable-test-hooks")


@contextmanager
def served(
    *args: str,
    clean: bool = False,
    exit_zero: bool = False,
    stop_timeout_s: float = 30.0,
    **start: Any,
) -> Iterator[ServeProcess]:
    """A server started with `args` for the block, stopped after. With `clean`, every
    block must end free or cached and the server must exit 0; with `exit_zero`, only
    the latter."""
    process = ServeProcess.start(*args, **start)
    try:
        yield process
        if clean:
            process.assert_blocks_free_or_cached()
    finally:
        code = process.stop(timeout_s=stop_timeout_s)
        if clean or exit_zero:
            assert code == 0, f"pdserve serve exited with {code}:\n{process.log()}"


class BackgroundStream:
    """A streaming completion (`body`) read on a thread: its text chunks and any error
    event, for tests that break the server while it streams."""

    def __init__(self, server: ServeProcess, body: dict) -> None:
        self.chunks: list[str] = []
        self.errors: list[str] = []
        self.done = False
        self._thread = threading.Thread(target=self._read, args=(server, body), daemon=True)
        self._thread.start()

    def _read(self, server: ServeProcess, body: dict) -> None:
        with (
            httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith('data: {"error"'):
                    self.errors.append(line)
                elif line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:])["choices"][0]["text"])
        self.done = True

    def join(self, timeout_s: float) -> str:
        """The text streamed, once the stream ended (within `timeout_s`)."""
        self._thread.join(timeout_s)
        assert self.done, "the stream did not end"
        return "".join(self.chunks)


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def pool(server: ServeProcess, role: str) -> list[str]:
    """The live instances of `role`, as /health lists them."""
    entries = server.get("/health").json()["instances"]
    return sorted(e["id"] for e in entries if e["role"] == role and e["alive"])


def counter(server: ServeProcess, name: str) -> float:
    """An unlabelled `pdserve:` counter's value from /metrics (0 when absent)."""
    match = re.search(rf"^pdserve:{name} (\S+)$", server.get("/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0
