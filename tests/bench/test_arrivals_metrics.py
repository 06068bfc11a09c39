"""Arrival processes, metric definitions and /metrics parsing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.metrics import (
    RequestOutcome,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    summarize,
)
from pdserve.bench.server_metrics import KV_USAGE_NAMES, first_present, parse_samples


def gaps(rate: float, burstiness: float, seed: int = 11, n: int = 40_000) -> np.ndarray:
    return np.diff(arrival_offsets(n, rate, burstiness, seed))


def test_poisson_arrivals_have_exponential_gaps_and_poisson_counts() -> None:
    g = gaps(10.0, 1.0)
    assert g.mean() == pytest.approx(0.1, rel=0.02)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.03)
    # Counts per 1 s window of a Poisson process: variance equals mean (10).
    counts = np.bincount(np.floor(arrival_offsets(40_000, 10.0, 1.0, 11)).astype(int))[:-1]
    assert counts.mean() == pytest.approx(10.0, rel=0.02)
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.08)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_variation(burstiness: float) -> None:
    g = gaps(5.0, burstiness)
    assert g.mean() == pytest.approx(0.2, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.04)


def test_arrival_edge_cases_and_determinism() -> None:
    assert list(arrival_offsets(4, math.inf)) == [0.0, 0.0, 0.0, 0.0]
    assert np.allclose(np.diff(arrival_offsets(5, 4.0, math.inf)), 0.25)
    assert arrival_offsets(3, 2.0)[0] == 0.0
    assert np.array_equal(arrival_offsets(50, 3.0, 1.0, 1), arrival_offsets(50, 3.0, 1.0, 1))
    assert not np.array_equal(arrival_offsets(50, 3.0, 1.0, 1), arrival_offsets(50, 3.0, 1.0, 2))
    with pytest.raises(ValueError, match="request rate must be positive"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness must be positive"):
        arrival_offsets(3, 1.0, -1.0)


def outcome(ttft: float, gaps_s: list[float], tokens: int | None = None, **kw) -> RequestOutcome:
    tokens = len(gaps_s) + 1 if tokens is None else tokens
    return RequestOutcome(
        success=True,
        prompt_len=10,
        output_tokens=tokens,
        ttft=ttft,
        itl=gaps_s,
        latency=ttft + sum(gaps_s),
        **kw,
    )


def test_summary_follows_vllm_definitions() -> None:
    outcomes = [
        outcome(0.1, [0.02, 0.04], start_time=0.0),  # TPOT 30 ms
        outcome(0.3, [0.01, 0.01, 0.01, 0.01], start_time=0.05),  # TPOT 10 ms
        outcome(0.2, [], start_time=0.5),  # one token: no TPOT
        RequestOutcome(success=False, error="HTTP 500: boom", prompt_len=10),
    ]
    result = summarize(
        outcomes, duration_s=2.0, percentiles=[50, 99.9], goodput_slos_ms={"ttft": 250, "tpot": 20}
    )
    assert (result["completed"], result["failed"]) == (3, 1)
    assert result["total_input_tokens"] == 30 and result["total_output_tokens"] == 9
    assert result["request_throughput"] == 1.5 and result["output_throughput"] == 4.5
    assert result["total_token_throughput"] == 19.5
    assert result["mean_tpot_ms"] == pytest.approx(20.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["mean_itl_ms"] == pytest.approx(100 / 6)
    assert "p99.9_itl_ms" in result and "p50_e2el_ms" in result
    # Only the single-token request is good (its TPOT counts as 0): the first misses
    # the TPOT SLO, the second the TTFT SLO.
    assert result["request_goodput"] == pytest.approx(1 / 2.0)
    assert result["errors"] == ["", "", "", "HTTP 500: boom"]
    assert result["output_lens"] == [3, 5, 1, 0]
    assert result["max_concurrent_requests"] == 2


def test_summary_of_an_all_failed_run_is_zeros() -> None:
    result = summarize([RequestOutcome(error="x"), RequestOutcome(error="y")], 1.0)
    assert result["completed"] == 0 and result["failed"] == 2
    assert result["mean_ttft_ms"] == 0.0 and result["request_goodput"] is None


def test_argument_parsers() -> None:
    assert parse_goodput(["ttft:500", "e2el:2.5"]) == {"ttft": 500.0, "e2el": 2.5}
    with pytest.raises(ValueError, match="must be one of ttft, tpot, e2el"):
        parse_goodput(["itl:5"])
    assert parse_percentiles("50, 95,99.9") == [50.0, 95.0, 99.9]
    assert parse_metric_names("ttft,itl") == ["ttft", "itl"]
    with pytest.raises(ValueError):
        parse_metric_names("ttft,foo")


def test_prometheus_text_parsing() -> None:
    text = """# HELP pdserve:kv_cache_usage_perc KV usage
# TYPE pdserve:kv_cache_usage_perc gauge
pdserve:kv_cache_usage_perc{role="prefill",instance="0"} 0.25
pdserve:kv_cache_usage_perc{role="decode",instance="1"} 0.75
vllm:num_preemptions_total{model_name="m"} 3.0
garbage line
"""
    samples = parse_samples(text)
    assert samples["pdserve:kv_cache_usage_perc"] == [0.25, 0.75]
    assert samples["vllm:num_preemptions_total"] == [3.0]
    assert first_present(samples, KV_USAGE_NAMES) == [0.25, 0.75]
    assert first_present(samples, ("missing",)) is None
