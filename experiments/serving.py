"""Real `pdserve serve` processes, shared by the tests and the experiments (not product
code): a child process on 127.0.0.1 on a free port, and the helpers around one.

    server = ServeProcess.start("--num-colocated", "1")
    client = server.openai()
    ...
    server.stop()

The server prints "pdserve: serving ... on http://HOST:PORT" once its instances are
ready; stderr goes to a file that failures quote. `served` is a server for a block,
`BackgroundStream` a streaming completion read on a thread, `pool` and `counter` read
/health and /metrics.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:  # imported where a client is made: the device check runs without openai
    import openai

API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"  # opens /debug/* on a server with keys
START_TIMEOUT_S = 240.0
SERVING = "pdserve: serving "


@dataclass
class ServeProcess:
    process: subprocess.Popen
    base_url: str
    log_path: str
    api_key: str | None
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(
        cls, *args: str, api_key: str | None = API_KEY, env: dict[str, str] | None = None
    ) -> ServeProcess:
        command = [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", *args]
        if api_key and "--api-key" not in args and "--api-keys-file" not in args:
            command += ["--api-key", api_key]
        if api_key and "--admin-api-key" not in args:
            command += ["--admin-api-key", ADMIN_KEY]
        full_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        with tempfile.NamedTemporaryFile(
            "w", prefix="pdserve-test-", suffix=".log", delete=False
        ) as log:  # the child keeps writing to its own copy of the descriptor
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                text=True, env=full_env,
            )  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(process, lines), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith(SERVING):
                url = line.rsplit(" on ", 1)[1].strip()
                return cls(process, url, log.name, api_key)
        process.kill()
        process.wait()
        raise RuntimeError(f"pdserve serve did not come up:\n{tail(log.name)}")

    # ---- clients ----------------------------------------------------------------------

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        import openai

        return openai.OpenAI(**self._client_args(kwargs))

    def async_openai(self, **kwargs: Any) -> openai.AsyncOpenAI:
        import openai

        return openai.AsyncOpenAI(**self._client_args(kwargs))

    def _client_args(self, overrides: dict[str, Any]) -> dict[str, Any]:
        args = {"base_url": f"{self.base_url}/v1", "api_key": self.api_key or "none",
                "max_retries": 0, "timeout": 120}  # fmt: skip
        return {**args, **overrides}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def headers_for(self, path: str) -> dict[str, str]:
        """The tenant's key, or the admin key for the operator endpoints (/debug/*)."""
        if self.api_key and path.startswith("/debug/"):
            return {"Authorization": f"Bearer {ADMIN_KEY}"}
        return self.headers

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers_for(path), **kwargs.pop("headers", {})}
        return httpx.get(self.base_url + path, headers=headers, timeout=60, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers_for(path), **kwargs.pop("headers", {})}
        return httpx.post(self.base_url + path, headers=headers, timeout=120, **kwargs)

    def instances(self) -> dict[str, dict]:
        response = self.get("/debug/instances")
        response.raise_for_status()
        return response.json()["instances"]

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Instances' books once no request is left anywhere (or the last look)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.instances()
            idle = all(
                not i["in_flight"]
                and i["inspection"] is not None
                and not i["inspection"]["unfinished_request_ids"]
                for i in found.values()
                if i["alive"]
            )
            if idle or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def assert_blocks_free_or_cached(self) -> None:
        """ARCHITECTURE.md's invariant: idle ⇒ every block on every instance free or cached."""
        for instance_id, found in self.wait_idle().items():
            if not found["alive"]:
                continue
            inspection = found["inspection"]
            assert inspection is not None, f"{instance_id} did not answer"
            assert inspection["invariant_error"] is None, (instance_id, inspection)
            assert inspection["unfinished_request_ids"] == [], (instance_id, inspection)
            assert inspection["block_owners"] == {}, (instance_id, inspection["block_owners"])
            assert inspection["num_free_blocks"] == inspection["num_total_blocks"], inspection

    # ---- stopping ---------------------------------------------------------------------

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        return tail(self.log_path)


def _pump(process: subprocess.Popen, lines: queue.Queue) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.put(line)
    lines.put(None)


def tail(path: str, count: int = 40) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-count:])
    except OSError:
        return ""


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

    def __init__(self, server: ServeProcess, body: dict, headers: dict | None = None) -> None:
        """`headers`: sent besides the tenant's key (e.g. a `traceparent`)."""
        self.chunks: list[str] = []
        self.errors: list[str] = []
        self.done = False
        headers = {**server.headers, **(headers or {})}
        self._thread = threading.Thread(
            target=self._read, args=(server, body, headers), daemon=True
        )
        self._thread.start()

    def _read(self, server: ServeProcess, body: dict, headers: dict) -> None:
        with (
            httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as client,
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


def gateway_threads(server: ServeProcess) -> int:
    """The gateway process's thread count (Linux: /proc)."""
    with open(f"/proc/{server.process.pid}/status") as status:
        return int(next(line for line in status if line.startswith("Threads:")).split()[1])


def assert_health_answers_within(server: ServeProcess, seconds: float) -> None:
    began = time.monotonic()
    assert server.get("/health").status_code == 200
    assert time.monotonic() - began < seconds
