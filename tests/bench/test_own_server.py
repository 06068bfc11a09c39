"""`pdserve bench serve` and `bench sweep` against our own server, colocated and 1P+1D.

Each mode gets one `pdserve serve --launcher local` (one torch thread per instance, the
machine is shared) for the whole module. Workloads are tiny (a handful of 16-token
prompts and 8-token answers) so the module stays within a minute or two; what is checked
is that the benchmark's JSON carries vLLM's field names and that its counts equal what
the server counted on `/metrics` while the benchmark ran.

The colocated server's KV pool is 5 blocks of 16 tokens: two requests (23 tokens of KV,
2 blocks each) fit, four do not, so the sweep's last step must preempt — and report exactly the
preemptions the server counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from experiments.serving import LOCAL, ServeProcess, served
from pdserve.cli import main

pytestmark = pytest.mark.slow

COMMON = (*LOCAL, "--dtype", "float32", "--max-model-len", "256")
MODES = {
    # A block: 16 tokens x 30 layers x 2 x 3 heads x 64 x 4 bytes = 0.7 MiB; 4 MiB hold 5,
    # so max_model_len must fit in 5 blocks (80 tokens; requests here are 24).
    "colocated": ("--mode", "colocated", "--num-colocated", "1", "--kv-cache-memory", "4MiB",
                  "--max-model-len", "80", "--block-size", "16"),
    "disaggregated": ("--num-prefill", "1", "--num-decode", "1", "--kv-cache-memory", "64MiB"),
}  # fmt: skip
INPUT_LEN, OUTPUT_LEN = 16, 8
VLLM_FIELDS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
    "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "input_lens", "output_lens", "ttfts",
    "itls", "errors", "num_prompts", "request_rate", "burstiness", "max_concurrency", "model_id",
)  # fmt: skip
COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "request_success_total",
            "num_preemptions_total")  # fmt: skip


@pytest.fixture(scope="module", params=list(MODES))
def server(request) -> Iterator[ServeProcess]:
    with served(*COMMON, *MODES[request.param], api_key=None, clean=True) as process:
        process.mode = request.param  # type: ignore[attr-defined]
        yield process


def counters(server: ServeProcess, role: str | None = None) -> dict[str, float]:
    """Each counter summed over the instances (of one role, if given)."""
    text = server.get("/metrics").text
    role_filter = f'[^}}]*role="{role}"' if role else ""
    totals = {}
    for name in COUNTERS:
        pattern = rf"^pdserve:{name}{{{role_filter}[^}}]*}} (\S+)$"
        totals[name] = sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))
    return totals


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


def dataset_flags(server: ServeProcess) -> list[str]:
    return [
        "--base-url", server.base_url, "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--disable-tqdm",
    ]  # fmt: skip


def first_token_role(server: ServeProcess) -> str:
    return "prefill" if server.mode == "disaggregated" else "colocated"


def test_bench_serve_counts_what_the_server_counted(server, tmp_path, capsys) -> None:
    path = tmp_path / "serve.json"
    before = counters(server)
    prompts_before = counters(server, first_token_role(server))["prompt_tokens_total"]
    code = main(
        [
            "bench", "serve", *dataset_flags(server), "--num-prompts", "6",
            "--max-concurrency", "2", "--num-warmups", "1", "--goodput", "ttft:60000",
            "tpot:60000", "--result-filename", str(path), "--seed", "7",
        ]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    result = json.loads(path.read_text())
    server.wait_idle()
    delta = moved(before, counters(server))
    prompts_delta = (
        counters(server, first_token_role(server))["prompt_tokens_total"] - prompts_before
    )

    assert set(VLLM_FIELDS) <= set(result), set(VLLM_FIELDS) - set(result)
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["model_id"] == "SmolLM2-135M-Instruct"
    # Token-id prompts of exact length; answers run to max_tokens (ignore_eos).
    assert result["input_lens"] == [INPUT_LEN] * 6
    assert result["output_lens"] == [OUTPUT_LEN] * 6
    assert result["total_input_tokens"] == 6 * INPUT_LEN
    assert result["total_output_tokens"] == 6 * OUTPUT_LEN
    # The one warm-up request reached the server too, with the first prompt.
    assert delta["request_success_total"] == 6 + 1
    assert prompts_delta == result["total_input_tokens"] + INPUT_LEN
    assert delta["generation_tokens_total"] == result["total_output_tokens"] + OUTPUT_LEN
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["output_throughput"] == pytest.approx(
        result["total_output_tokens"] / result["duration"]
    )
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"]
    assert 0 < result["median_itl_ms"] <= result["p99_itl_ms"]
    assert result["median_ttft_ms"] < result["median_e2el_ms"]
    assert all(1 <= len(gaps) <= OUTPUT_LEN - 1 for gaps in result["itls"])
    assert result["max_concurrent_requests"] <= 2
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_sweep_records_server_metrics(server, tmp_path, capsys) -> None:
    path = tmp_path / "sweep.json"
    before = counters(server)
    code = main(
        [
            "bench", "sweep", *dataset_flags(server), "--concurrency-steps", "1,2,4",
            "--requests-per-step", "4", "--num-warmups", "1", "--warmup-concurrency", "1",
            "--ttft-slo-ms", "60000", "--itl-slo-ms", "60000", "--plateau-gain", "-1",
            "--result-filename", str(path), "--seed", "3",
            # A request of 16 + 8 tokens can end between two scrapes 0.5 s apart.
            "--metrics-interval-s", "0.02",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(path.read_text())
    server.wait_idle()
    delta = moved(before, counters(server))
    steps = result["steps"]
    preempting = server.mode == "colocated"

    # Colocated: the 5-block pool holds two requests, not four; 1P+1D never preempts.
    assert [s["concurrency"] for s in steps] == [1, 2, 4]
    assert [s["num_preemptions"] for s in steps[:2]] == [0, 0]
    if preempting:
        assert steps[2]["num_preemptions"] > 0
        assert result["stopped_at"]["reasons"] == [f"{steps[2]['num_preemptions']:g} preemptions"]
        assert result["working_point"]["base_concurrency"] == 2
    else:
        assert steps[2]["num_preemptions"] == 0 and result["stopped_at"] is None
        assert result["working_point"]["base_concurrency"] == 4
    assert sum(s["num_preemptions"] for s in steps) == delta["num_preemptions_total"]
    for s in steps:
        assert s["completed"] == 4 and s["failed"] == 0, s["errors"]
        assert s["total_output_tokens"] == 4 * OUTPUT_LEN
        assert 0 < s["kv_cache_usage_perc"] <= 1
        assert {"p50_ttft_ms", "p95_ttft_ms", "p95_itl_ms", "output_throughput"} <= set(s)
    # Four requests keep the colocated server's pool at least 4/5 full (peaks of a
    # 0.5 s poll; two running requests alone hold 4 of the 5 blocks).
    if preempting:
        assert steps[2]["kv_cache_usage_perc"] >= 0.8
    # Warm-up, steps, and the one-token prefill probe at the working point's base.
    probe = 0 if result["capacity"] is None else 4
    assert delta["request_success_total"] == 1 + sum(s["completed"] for s in steps) + probe
    generated = OUTPUT_LEN + sum(s["total_output_tokens"] for s in steps) + probe
    assert delta["generation_tokens_total"] == generated
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "working point" in out
