"""Two colocated instances under the local launcher: admission, leaks, failover, shutdown.

The tests run in file order on one server and build on each other: the last ones kill
and freeze instances, and the very last stops the server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from experiments.serving import LOCAL, MODEL, ServeProcess, served
from tests.processes import still_running

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL, "--mode", "colocated", "--num-colocated", "2",
    "--max-num-seqs", "1", "--max-queued-requests", "0", "--routing-policy", "round_robin",
    "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
    "--instance-timeout", "4",
)  # fmt: skip
LONG = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0, "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS) as process:
        try:
            yield process
        finally:  # frozen instances go on, so that they can stop
            for pid in getattr(process, "frozen", []):
                _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def pids(server: ServeProcess) -> dict[str, int]:
    return {i: found["pid"] for i, found in server.instances().items()}


def complete(server: ServeProcess, prompt: str = "Hello", max_tokens: int = 3):
    return server.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0
    )


class HeldStream:
    """A streaming request kept open (its instance seat taken) until closed."""

    def __init__(self, server: ServeProcess) -> None:
        self.client = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
        self.context = self.client.stream("POST", "/v1/completions", json=LONG)
        self.response = self.context.__enter__()
        self.lines = self.response.iter_lines()
        next(line for line in self.lines if line.startswith("data: "))  # it is running

    def close(self) -> None:
        self.context.__exit__(None, None, None)
        self.client.close()


def test_round_robin_uses_both_instances(server) -> None:
    for _ in range(2):
        complete(server)
    text = server.get("/metrics").text
    for instance in ("colocated-0", "colocated-1"):
        line = next(
            ln for ln in text.splitlines()
            if ln.startswith("pdserve:generation_tokens_total{") and instance in ln
        )  # fmt: skip
        assert float(line.rsplit(" ", 1)[1]) >= 1, line
    server.assert_blocks_free_or_cached()


def test_startup_names_the_kernels_each_instance_runs(server) -> None:
    from pdserve.kernels import dispatch

    with open(server.log_path) as log:
        text = log.read()
    # Same machine, same compiler: the instances run what this process would.
    for instance in ("colocated-0", "colocated-1"):
        assert f"{instance} ready (kernels: {dispatch.cpu_kernels_status()})" in text


def test_full_server_answers_503_with_retry_after(server) -> None:
    held = [HeldStream(server), HeldStream(server)]  # one seat per instance, no queue
    try:
        response = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "overloaded"
        assert "pdserve:num_requests_rejected_total 1.0" in server.get("/metrics").text
    finally:
        for stream in held:
            stream.close()
    server.wait_idle()
    assert complete(server).usage.completion_tokens >= 1  # serving again
    server.assert_blocks_free_or_cached()


def test_the_invariant_check_catches_a_leaked_block(server) -> None:
    response = server.post("/debug/instances/colocated-0/leak?blocks=2")
    assert response.status_code == 200, response.text
    found = server.instances()["colocated-0"]["inspection"]
    assert "blocks held by requests the scheduler does not know" in found["invariant_error"]
    owners = found["block_owners"]
    assert len(owners) == 2 and all(o == ["leaked-on-purpose"] for o in owners.values())
    with pytest.raises(AssertionError):
        server.assert_blocks_free_or_cached()
    assert server.instances()["colocated-1"]["inspection"]["invariant_error"] is None


def test_a_request_whose_instance_dies_before_its_first_token_is_retried(server) -> None:
    expected = complete(server, "The capital of France is", 4).choices[0].text
    victim = pids(server)["colocated-0"]  # the instance with the leaked blocks
    os.kill(victim, signal.SIGSTOP)  # frozen: whatever it gets never starts
    results: list = [None, None]

    def ask(slot: int) -> None:
        results[slot] = complete(server, "The capital of France is", 4)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # both dispatched, one of them to the frozen instance
    os.kill(victim, signal.SIGKILL)  # the launcher sees it exit
    for thread in threads:
        thread.join(timeout=120)
    assert [r.choices[0].text for r in results] == [expected, expected]
    found = server.instances()
    assert found["colocated-0"]["alive"] is False
    assert found["colocated-1"]["alive"] is True
    metrics = server.get("/metrics").text
    assert 'pdserve:instance_up{instance="colocated-0",role="colocated"} 0.0' in metrics
    assert "pdserve:num_requests_retried_total 1.0" in metrics
    server.assert_blocks_free_or_cached()  # checks the survivor


def test_instances_without_heartbeats_are_fenced_and_killed(server) -> None:
    # The killed colocated-0 is restarted: once it is back, both go silent.
    deadline = time.monotonic() + 60
    while not server.instances()["colocated-0"]["alive"] and time.monotonic() < deadline:
        time.sleep(0.5)
    server.frozen = list(pids(server).values())  # type: ignore[attr-defined]
    for pid in server.frozen:  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while server.get("/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.get("/health").status_code == 503
    response = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert response.status_code == 503
    assert "no instance" in response.json()["error"]["message"]
    text = server.get("/metrics").text
    assert len(re.findall(r"^pdserve:num_instances_fenced_total{.*} 1\.0$", text, re.M)) == 2
    assert not still_running(server.frozen, 10)  # killed, paused as they were


def test_sigterm_stops_everything_and_frees_the_port(server) -> None:
    children = list(pids(server).values())
    for pid in getattr(server, "frozen", []):
        _signal(pid, signal.SIGCONT)
    port = int(server.base_url.rsplit(":", 1)[1])
    assert server.stop(timeout_s=30) == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
