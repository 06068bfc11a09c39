"""`bench serve` against the scripted server: latencies, counts, failures, schedules."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.datasets import DatasetSpec, build_samples
from pdserve.bench.runner import RunConfig, run_benchmark
from pdserve.bench.tokenizer import pick_tokenizer


def run(samples, **config) -> dict:
    return asyncio.run(run_benchmark(samples, RunConfig(show_progress=False, **config)))


def within(value: float, target: float, tolerance: float) -> bool:
    return abs(value - target) <= tolerance * target


@pytest.mark.slow
def test_measures_scripted_latencies_and_counts_match_server(scripted_server) -> None:
    scripted_server.script(ttft_s=0.2, itl_s=0.02)
    spec = DatasetSpec(num_prompts=12, random_input_len=32, random_output_len=16, seed=1)
    samples = build_samples(spec, pick_tokenizer(scripted_server.base_url, None))
    result = run(samples, base_url=scripted_server.base_url, max_concurrency=2, num_warmups=2)
    stats = scripted_server.stats()

    assert result["completed"] == 12 and result["failed"] == 0
    assert result["model_id"] == "scripted-model"
    assert within(result["median_ttft_ms"], 200.0, 0.10), result["median_ttft_ms"]
    assert within(result["median_itl_ms"], 20.0, 0.10), result["median_itl_ms"]
    # Medians against the script: one late wake-up on a busy machine moves a mean, not
    # a median. The mean is checked against the client's own gaps: TPOT runs to [DONE],
    # which comes right after the last token, so it is at least their mean and barely more.
    assert within(result["median_tpot_ms"], 20.0, 0.10), result["median_tpot_ms"]
    gaps_ms = sum(1000.0 * sum(gaps) / len(gaps) for gaps in result["itls"]) / 12
    assert gaps_ms - 1e-6 <= result["mean_tpot_ms"] <= gaps_ms + 5.0, (result, gaps_ms)
    expected_e2e = 200.0 + 15 * 20.0
    assert within(result["median_e2el_ms"], expected_e2e, 0.10), result["median_e2el_ms"]
    # Warm-ups reach the server but stay out of the results.
    assert stats["requests"] == 12 + 2
    warmup_prompt_tokens = 2 * samples[0].prompt_len
    assert result["total_input_tokens"] == stats["prompt_tokens"] - warmup_prompt_tokens
    assert result["total_output_tokens"] == stats["completion_tokens"] - 2 * 16
    assert result["total_output_tokens"] == 12 * 16
    assert stats["max_active"] <= 2
    assert len(result["itls"]) == 12 and all(len(gaps) == 15 for gaps in result["itls"])
    assert result["output_throughput"] == pytest.approx(
        result["total_output_tokens"] / result["duration"]
    )


def test_counts_chunks_when_the_server_reports_no_usage(scripted_server) -> None:
    scripted_server.script(ttft_s=0.01, itl_s=0.001, usage=False)
    spec = DatasetSpec(num_prompts=4, random_input_len=8, random_output_len=7, seed=2)
    result = run(build_samples(spec), base_url=scripted_server.base_url)
    assert result["completed"] == 4
    assert result["output_lens"] == [7, 7, 7, 7]
    assert scripted_server.stats()["completion_tokens"] == 28


def test_token_id_prompts_have_exact_lengths_with_server_tokenizer(scripted_server) -> None:
    scripted_server.script(ttft_s=0.01, itl_s=0.001)
    tokenizer = pick_tokenizer(scripted_server.base_url, None)
    assert tokenizer.exact
    spec = DatasetSpec(
        num_prompts=6, random_input_len=50, random_output_len=2, random_range_ratio=0.5, seed=3
    )
    samples = build_samples(spec, tokenizer)
    assert all(isinstance(s.prompt, list) and len(s.prompt) == s.prompt_len for s in samples)
    result = run(samples, base_url=scripted_server.base_url)
    assert scripted_server.stats()["prompt_tokens"] == sum(s.prompt_len for s in samples)
    assert result["input_lens"] == [s.prompt_len for s in samples]


@pytest.mark.parametrize("status", [500, 429])
def test_error_statuses_are_reported_as_failed(scripted_server, status: int) -> None:
    scripted_server.script(status=status)
    samples = build_samples(DatasetSpec(num_prompts=5, random_input_len=8, random_output_len=4))
    started = time.monotonic()
    result = run(samples, base_url=scripted_server.base_url, timeout_s=5)
    assert time.monotonic() - started < 5
    assert result["completed"] == 0 and result["failed"] == 5
    assert all(e.startswith(f"HTTP {status}") for e in result["errors"])
    assert result["request_throughput"] == 0.0
    assert scripted_server.stats()["requests"] == 5


def test_unreachable_server_reports_failures_quickly(refused_url: str) -> None:
    samples = build_samples(DatasetSpec(num_prompts=5, random_input_len=8, random_output_len=4))
    started = time.monotonic()
    result = run(samples, base_url=refused_url, timeout_s=5, model="m")
    assert time.monotonic() - started < 5
    assert result["completed"] == 0 and result["failed"] == 5
    assert all("ConnectError" in e for e in result["errors"])


def test_hanging_server_is_bounded_by_the_request_timeout(scripted_server) -> None:
    scripted_server.script(ttft_s=30.0)
    samples = build_samples(DatasetSpec(num_prompts=3, random_input_len=8, random_output_len=4))
    started = time.monotonic()
    result = run(samples, base_url=scripted_server.base_url, timeout_s=0.5)
    assert time.monotonic() - started < 3
    assert result["failed"] == 3
    assert all(e == "timed out after 0.5 s" for e in result["errors"])


def test_goodput_counts_requests_within_every_slo(scripted_server) -> None:
    scripted_server.script(ttft_s=0.05, itl_s=0.005)
    samples = build_samples(DatasetSpec(num_prompts=6, random_input_len=8, random_output_len=5))
    loose = run(
        samples, base_url=scripted_server.base_url, goodput_slos_ms={"ttft": 500, "tpot": 100}
    )
    tight = run(samples, base_url=scripted_server.base_url, goodput_slos_ms={"ttft": 10})
    assert loose["request_goodput"] == pytest.approx(loose["request_throughput"])
    assert tight["request_goodput"] == 0.0
    assert run(samples, base_url=scripted_server.base_url)["request_goodput"] is None


def test_requests_follow_the_arrival_schedule(scripted_server) -> None:
    scripted_server.script(ttft_s=0.005, itl_s=0.001)
    samples = build_samples(DatasetSpec(num_prompts=12, random_input_len=8, random_output_len=2))
    result = run(samples, base_url=scripted_server.base_url, request_rate=10.0, seed=7)
    last_send = arrival_offsets(12, 10.0, 1.0, seed=7)[-1]
    assert last_send < result["duration"] < last_send + 0.5
    assert result["request_rate"] == 10.0 and result["burstiness"] == 1.0


def test_max_concurrency_bounds_requests_in_flight(scripted_server) -> None:
    scripted_server.script(ttft_s=0.05, itl_s=0.005)
    samples = build_samples(DatasetSpec(num_prompts=12, random_input_len=8, random_output_len=4))
    result = run(samples, base_url=scripted_server.base_url, max_concurrency=3)
    assert scripted_server.stats()["max_active"] == 3
    assert result["max_concurrent_requests"] == 3
