"""One prefill and two decode instances (local processes), a short `--instance-timeout`:
a decode instance paused (SIGSTOP) past the timeout under streams is fenced: its streams
migrate to the other decode instance and complete as a fault-free run would, it is
killed (its process is gone even once resumed) and a replacement registers, the fence
and the restart counted in /metrics; a prefill instance killed while its request decodes
on a decode instance leaves that stream whole, and its load leaves /health and /metrics
at once.

The tests run in file order on one server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from tests.cluster.serving import LOCAL, MODEL, BackgroundStream, served
from tests.gateway.server import ServeProcess

pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0
ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "2", "--dtype", "float32",
    "--kv-cache-memory", "48MiB", "--max-model-len", "1024", "--routing-policy", "round_robin",
    "--instance-timeout", str(TIMEOUT_S),
)  # fmt: skip
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS) as process:
        yield process


def complete(server: ServeProcess, max_tokens: int) -> str:
    return server.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip


class Stream(BackgroundStream):
    """A greedy streaming completion read on a thread: its text and any error event."""

    def __init__(self, server: ServeProcess, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        super().__init__(server, body)


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def prefill_alive(server: ServeProcess) -> bool:
    entries = {e["id"]: e for e in server.get("/health").json()["instances"]}
    return entries["prefill-0"]["alive"]


def health(server: ServeProcess) -> int:
    return server.get("/health").status_code


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] == "Z"  # killed, not yet reaped
    except FileNotFoundError:
        return True


def metric(server: ServeProcess, pattern: str) -> float:
    match = re.search(rf"^pdserve:{pattern} (\S+)$", server.get("/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_paused_decode_instance_is_fenced_killed_and_replaced(server) -> None:
    expected = complete(server, 80)
    pid = server.instances()["decode-0"]["pid"]
    streams = [Stream(server, 80) for _ in range(2)]  # round robin: one on each decoder
    wait_for(lambda: all(len(s.chunks) >= 3 for s in streams), 60, "the streams to decode")
    assert not any(s.done for s in streams)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(TIMEOUT_S + 5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed already, as it should be
            os.kill(pid, signal.SIGCONT)
    for stream in streams:  # decode-0's stream went on on decode-1
        assert stream.join(120) == expected and stream.errors == []
    assert metric(server, "requests_migrated_total") == 1.0
    wait_for(lambda: gone(pid), 10, "the paused process to be killed")
    wait_for(lambda: server.instances()["decode-0"]["alive"], 60, "decode-0's replacement")
    assert server.instances()["decode-0"]["pid"] != pid
    assert metric(server, 'num_instances_fenced_total{instance="decode-0",role="decode"}') == 1.0
    assert metric(server, "num_instances_restarted_total") == 1.0
    assert health(server) == 200 and expected.startswith(complete(server, 8))
    server.assert_blocks_free_or_cached()


def test_a_prefill_death_spares_a_stream_decoding_elsewhere(server) -> None:
    expected = complete(server, 120)
    pid = server.instances()["prefill-0"]["pid"]
    stream = Stream(server, 120)
    wait_for(lambda: len(stream.chunks) >= 10, 60, "the stream to decode on decode-0")
    os.kill(pid, signal.SIGKILL)
    # Seen at once (its restart takes a while longer: its weights load).
    wait_for(lambda: not prefill_alive(server), 5, "prefill-0's death to be seen")
    entries = {e["id"]: e for e in server.get("/health").json()["instances"]}
    assert "num_running" not in entries["prefill-0"]
    text = server.get("/metrics").text
    assert re.search(r'^pdserve:instance_up{instance="prefill-0",[^}]*} 0\.0$', text, re.M)
    for series in ("pdserve:num_requests_running", "vllm:num_requests_running"):
        assert not re.search(rf'^{series}{{[^}}]*"prefill-0"', text, re.M), series
    stream.join(60)
    assert stream.errors == []
    assert "".join(stream.chunks) == expected
    assert complete(server, 8) == complete(server, 8) != ""  # decode-0 alone serves on
    server.assert_blocks_free_or_cached()
