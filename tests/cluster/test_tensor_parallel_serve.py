"""Disaggregated serving with different tensor-parallel sizes on each side (local
processes, the embedded model: 9 heads, 3 KV heads): P at TP=3 hands its KV, head slice by
head slice, to D at TP=1, and the reverse; greedy text equals the single-process engine's
and the KV bytes moved show in /metrics."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from pdserve.scheduler.sampling_params import SamplingParams
from tests.cluster.serving import LOCAL, MODEL, served

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32",
    "--kv-cache-memory", "64MiB", "--max-model-len", "512",
)  # fmt: skip
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a dragon"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def greedy() -> list[str]:
    from pdserve import LLM

    llm = LLM(dtype="float32", num_threads=1, kv_cache_memory=64 << 20, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def _kv_bytes(text: str, role: str) -> float:
    pattern = rf'^pdserve:kv_transfer_bytes_total{{[^}}]*role="{role}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


@pytest.mark.parametrize(
    "sizes",
    [("--prefill-tensor-parallel-size", "3"), ("--decode-tensor-parallel-size", "3")],
    ids=["P3-D1", "P1-D3"],
)
def test_mixed_tp_sizes_serve_the_single_engines_text(greedy, sizes) -> None:
    with served(*ARGS, *sizes, clean=True) as server:
        client = server.openai()
        for prompt, want in zip(PROMPTS, greedy, strict=True):
            result = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert result.choices[0].text == want, prompt
        metrics = server.get("/metrics").text
        assert _kv_bytes(metrics, "prefill") > 0
        assert _kv_bytes(metrics, "decode") == _kv_bytes(metrics, "prefill")


def test_a_killed_rank_ends_its_instance_and_its_stream_goes_on_elsewhere() -> None:
    args = (*LOCAL, "--mode", "colocated", "--num-colocated", "2", "-tp", "3", "--dtype",
            "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "512")  # fmt: skip
    with served(*args) as server:
        client = server.openai()
        request = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 60,
                   "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
        expected = client.completions.create(**request).choices[0].text
        text: list[str] = []

        def stream() -> None:
            for chunk in client.completions.create(**request, stream=True):
                text.append(chunk.choices[0].text)

        worker = threading.Thread(target=stream)
        worker.start()
        deadline = time.monotonic() + 30
        while not (len(text) >= 2 and (owner := _owner(server))):
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.05)
        ranks = _rank_pids(server.instances()[owner]["pid"])
        assert len(ranks) == 3
        os.kill(ranks[1], signal.SIGKILL)
        worker.join(timeout=60)
        assert not worker.is_alive(), "the stream hung after a rank died"
        assert "".join(text) == expected  # migrated to the other instance, no error
        deadline = time.monotonic() + 15
        while _alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(ranks)  # the instance exited with its group
        metrics = server.get("/metrics").text
        assert re.search(r"^pdserve:requests_migrated_total 1\.0$", metrics, re.M)


def _owner(server) -> str | None:
    """The instance the one request in flight runs on, once it streams."""
    for instance_id, found in server.instances().items():
        if found["in_flight"] and found["alive"]:
            return instance_id
    return None


def _rank_pids(root: int) -> list[int]:
    """The worker-group ranks under the server: grandchildren run by multiprocessing."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
        except OSError:
            continue
        if any(b"spawn_main" in a for a in args) and _descends(int(entry), root):
            found.append(int(entry))
    return found


def _descends(pid: int, root: int) -> bool:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == root:
            return True
    return False


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive
