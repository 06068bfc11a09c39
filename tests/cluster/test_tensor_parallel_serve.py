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

from experiments.serving import LOCAL, MODEL, served
from pdserve.common.sampling_params import SamplingParams
from tests.processes import still_running

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


def _rank_kv_bytes(text: str, role: str) -> dict[str, float]:
    pattern = rf'^pdserve:kv_transfer_rank_bytes_total{{([^}}]*role="{role}"[^}}]*)}} (\S+)$'
    found = {}
    for labels, value in re.findall(pattern, text, re.MULTILINE):
        found[re.search(r'rank="(\d+)"', labels).group(1)] = float(value)
    return found


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
        # Per rank: the TP=3 side's three ranks each moved a third (their heads' slice),
        # the TP=1 side's one rank all of it.
        total = _kv_bytes(metrics, "prefill")
        wide, narrow = (
            ("prefill", "decode") if sizes[0].startswith("--prefill") else ("decode", "prefill")
        )
        assert _rank_kv_bytes(metrics, wide) == {str(r): total / 3 for r in range(3)}
        assert _rank_kv_bytes(metrics, narrow) == {"0": total}


def test_a_killed_rank_ends_its_instance_which_fails_no_request_itself() -> None:
    """The instance exits rather than fail its requests: the gateway handles them as for
    any exit (migrated while another instance lives: test_recovery.py; here none does,
    so the stream ends naming the rank its instance lost), and it is restarted."""
    args = (*LOCAL, "--mode", "colocated", "--num-colocated", "1", "-tp", "3",
            "--kv-cache-memory", "64MiB", "--max-model-len", "512")  # fmt: skip
    with served(*args) as server:
        client = server.openai()
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
        ranks = _rank_pids(server.process.pid)
        assert len(ranks) == 3
        outcome: dict[str, object] = {}

        def stream() -> None:
            try:
                for _ in client.completions.create(
                    model=MODEL, prompt="Tell a long story", max_tokens=400, stream=True,
                    extra_body={"ignore_eos": True},
                ):  # fmt: skip
                    outcome["started"] = True
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                outcome["error"] = str(exc)

        worker = threading.Thread(target=stream)
        worker.start()
        deadline = time.monotonic() + 30
        while "started" not in outcome and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = server.instances()["colocated-0"]["pid"]
        os.kill(ranks[1], signal.SIGKILL)
        worker.join(timeout=15)
        assert not worker.is_alive(), "the stream hung after a rank died"
        error = str(outcome.get("error"))
        assert "failed mid-request: it lost its worker group: rank 1" in error, outcome
        assert not still_running([*ranks, pid], 15)  # the instance with its group
        deadline = time.monotonic() + 60
        while server.instances()["colocated-0"]["pid"] == pid:
            assert time.monotonic() < deadline, "colocated-0 was not started again"
            time.sleep(0.2)


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
