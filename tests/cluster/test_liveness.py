"""One prefill and one decode instance (local processes): a prefill instance killed while
its request decodes on the decode instance leaves that stream whole, and its load leaves
/health and /metrics at once. (A paused instance, fenced and replaced:
tests/cluster/test_recovery.py.)
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from experiments.serving import LOCAL, MODEL, BackgroundStream, ServeProcess, served

pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0
ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "1", "--dtype", "bfloat16",
    "--kv-cache-memory", "24MiB", "--max-model-len", "1024",
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
