"""`bench sweep`: the stop rule, the working point, and a reduced sweep end to end."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.bench.datasets import DatasetSpec, build_samples
from pdserve.bench.sweep import (
    SweepConfig,
    phase_throughputs,
    run_sweep,
    stop_reasons,
    working_point,
)
from pdserve.bench.sweep_plot import plot_sweep


def step(concurrency: int, throughput: float, **overrides) -> dict:
    record = {
        "concurrency": concurrency,
        "failed": 0,
        "p95_ttft_ms": 100.0,
        "p95_itl_ms": 20.0,
        "output_throughput": throughput,
        "num_preemptions": 0,
    }
    record.update(overrides)
    return record


def test_stop_rule_names_each_broken_limit() -> None:
    config = SweepConfig(ttft_slo_ms=500, itl_slo_ms=50, plateau_gain=0.10)
    assert stop_reasons(step(4, 400.0), step(1, 120.0), config) == []
    assert stop_reasons(step(8, 430.0), step(4, 400.0), config) == [
        "throughput plateau: +7.5% over concurrency 4 (< 10%)"
    ]
    reasons = stop_reasons(
        step(8, 900.0, p95_ttft_ms=620.0, p95_itl_ms=51.0, num_preemptions=3, failed=2),
        step(4, 400.0),
        config,
    )
    assert reasons == [
        "2 requests failed",
        "p95 TTFT 620.0 ms > SLO 500 ms",
        "p95 ITL 51.0 ms > SLO 50 ms",
        "3 preemptions",
    ]


def test_working_point_is_last_good_step_less_20_to_25_percent() -> None:
    steps = [step(c, 100.0 * c) for c in (1, 4, 8, 16, 32)]
    assert working_point(steps, 4, (0.20, 0.25)) == {
        "base_concurrency": 16,
        "concurrency_low": 12,
        "concurrency_high": 12,
        "note": "last good step",
    }
    unstopped = working_point(steps, None, (0.20, 0.25))
    assert (unstopped["concurrency_low"], unstopped["concurrency_high"]) == (24, 25)
    assert working_point(steps, 0, (0.20, 0.25)) is None


def test_phase_throughputs_from_a_prefill_probe() -> None:
    base = {
        "concurrency": 8,
        "input_throughput": 3000.0,
        "output_throughput": 400.0,
        "request_throughput": 2.0,
        "mean_input_tokens": 1500.0,
        "mean_output_tokens": 200.0,
    }
    # Prefill alone runs at 12000 tok/s, so the step spent a quarter of its time on it
    # and the remaining three quarters produced 400 output tok/s on two GPUs.
    capacity = phase_throughputs(base, {"input_throughput": 12000.0}, SweepConfig(num_gpus=2))
    assert capacity["prefill_tokens_per_s_per_gpu"] == pytest.approx(6000.0)
    assert capacity["prefill_time_share"] == pytest.approx(0.25)
    assert capacity["decode_tokens_per_s_per_gpu"] == pytest.approx(400.0 / (2 * 0.75))
    pools = phase_throughputs(base, None, SweepConfig(num_prefill_gpus=1, num_decode_gpus=3))
    assert pools["prefill_tokens_per_s_per_gpu"] == pytest.approx(3000.0)
    assert pools["decode_tokens_per_s_per_gpu"] == pytest.approx(400.0 / 3)


def reduced_config(base_url: str, **overrides) -> SweepConfig:
    settings = dict(
        base_url=base_url,
        concurrency_steps=[1, 2, 4, 8],
        requests_per_step=8,
        num_warmups=4,
        ttft_slo_ms=1000.0,
        itl_slo_ms=30.0,
        show_progress=False,
        metrics_interval_s=0.05,
    )
    settings.update(overrides)
    return SweepConfig(**settings)


@pytest.mark.slow
def test_reduced_sweep_stops_on_itl_and_writes_json_and_png(scripted_server, tmp_path) -> None:
    # ITL grows 20 ms per other request in flight: 40, 60, 100, 180 ms at 1, 2, 4, 8,
    # while throughput still gains 33%, 20%, 11% from step to step.
    scripted_server.script(ttft_s=0.02, itl_s=0.04, itl_per_active_s=0.02, kv_capacity=8)
    config = reduced_config(scripted_server.base_url, itl_slo_ms=140.0)
    spec = DatasetSpec(
        num_prompts=config.requests_needed(), random_input_len=16, random_output_len=8
    )
    result = asyncio.run(run_sweep(build_samples(spec), config))

    assert [s["concurrency"] for s in result["steps"]] == [1, 2, 4, 8]
    assert result["stopped_at"]["concurrency"] == 8
    assert any(r.startswith("p95 ITL") for r in result["stopped_at"]["reasons"])
    assert result["working_point"]["base_concurrency"] == 4
    assert result["working_point"]["concurrency_low"] == 3
    assert result["warmup"]["completed"] == 4
    for s in result["steps"]:
        assert s["completed"] == 8
        assert 0.0 < s["kv_cache_usage_perc"] <= s["concurrency"] / 8 + 1e-9
        assert s["num_preemptions"] == 0
    assert result["steps"][-1]["kv_cache_usage_perc"] >= 0.5
    # Warm-up, four steps and the prefill probe: every request reached the server.
    assert scripted_server.stats()["requests"] == 4 + 4 * 8 + 8
    capacity = result["capacity"]
    assert capacity["concurrency"] == 4
    assert capacity["prefill_tokens_per_s_per_gpu"] > capacity["input_tokens_per_s"]

    json_path = tmp_path / "sweep.json"
    json_path.write_text(json.dumps(result))
    assert json.loads(json_path.read_text())["steps"][2]["p95_itl_ms"] < 140.0
    png = plot_sweep(result, tmp_path / "sweep.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_sweep_stops_when_preemptions_appear(scripted_server) -> None:
    # A 0.2 s first token keeps the step's four requests in flight together even when
    # a busy machine staggers their sends.
    scripted_server.script(ttft_s=0.2, itl_s=0.005, preempt_above=2)
    config = reduced_config(
        scripted_server.base_url,
        concurrency_steps=[1, 2, 4],
        requests_per_step=4,
        num_warmups=0,
        prefill_probe=False,
        plateau_gain=-1.0,
        itl_slo_ms=1000.0,
    )
    spec = DatasetSpec(
        num_prompts=config.requests_needed(), random_input_len=8, random_output_len=4
    )
    result = asyncio.run(run_sweep(build_samples(spec), config))
    assert result["stopped_at"]["concurrency"] == 4, result["stopped_at"]
    assert result["stopped_at"]["reasons"] == ["2 preemptions"]
    assert result["working_point"]["base_concurrency"] == 2
    assert result["capacity"]["method"].startswith("none")
