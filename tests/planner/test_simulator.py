"""Latency-model fitting and the discrete-event simulator on synthetic models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.planner.sim.latency import (
    Calibration,
    StepLatencyModel,
    StepSample,
    fit_latency_model,
    fit_quality,
    load_calibration,
    prefill_pairs,
)
from pdserve.planner.sim.search import SearchSpec, search_placements
from pdserve.planner.sim.simulator import (
    ClusterConfig,
    Workload,
    make_workload,
    simulate,
    summarize_simulation,
)


def synthetic_samples(model: StepLatencyModel, points, noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        StepSample(
            tokens, pairs, model.predict(tokens, pairs) * (1 + noise * rng.standard_normal())
        )
        for tokens, pairs in points
    ]


def test_fit_recovers_a_known_model() -> None:
    truth = StepLatencyModel(intercept_s=0.01, per_token_s=2e-5, per_pair_s=3e-9)
    points = [(n * b, b * prefill_pairs(n)) for n in (128, 512, 1024, 2048) for b in (1, 2, 4)]
    exact = fit_latency_model(synthetic_samples(truth, points, noise=0.0))
    assert exact.intercept_s == pytest.approx(0.01, rel=1e-6)
    assert exact.per_token_s == pytest.approx(2e-5, rel=1e-6)
    assert exact.per_pair_s == pytest.approx(3e-9, rel=1e-6)
    noisy_samples = synthetic_samples(truth, points, noise=0.03, seed=1)
    noisy = fit_latency_model(noisy_samples)
    assert noisy.predict(4096, 4 * prefill_pairs(1024)) == pytest.approx(
        truth.predict(4096, 4 * prefill_pairs(1024)), rel=0.05
    )
    assert fit_quality(noisy, noisy_samples)["r2"] > 0.98


def test_fit_keeps_coefficients_non_negative() -> None:
    # Times that fall slightly with batch size would give a negative per-token cost.
    samples = [StepSample(b, 100 * b, 0.02 - 1e-5 * b) for b in (1, 2, 4, 8, 16)]
    model = fit_latency_model(samples)
    assert model.per_token_s >= 0 and model.per_pair_s >= 0
    assert model.intercept_s == pytest.approx(0.0199, rel=0.02)


def test_calibration_file_fits_both_phases(tmp_path) -> None:
    prefill = StepLatencyModel(0.02, 5e-5, 1e-9)
    decode = StepLatencyModel(0.008, 4e-4, 2e-8)
    data = {
        "tp": 1,
        "prefill": [
            {
                "batch_tokens": n,
                "attention_pairs": prefill_pairs(n),
                "seconds": prefill.predict(n, prefill_pairs(n)),
            }
            for n in (64, 256, 1024, 2048)
        ],
        "decode": [
            {"batch_tokens": b, "attention_pairs": b * c, "seconds": decode.predict(b, b * c)}
            for b in (1, 8, 32)
            for c in (128, 1024)
        ],
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    calibration = load_calibration(str(path))
    assert calibration.decode.per_token_s == pytest.approx(4e-4, rel=1e-6)
    assert calibration.prefill.intercept_s == pytest.approx(0.02, rel=1e-6)
    path.write_text(json.dumps({"prefill": [{"batch_tokens": 1}], "decode": []}))
    with pytest.raises(ValueError, match="needs batch_tokens, attention_pairs and seconds"):
        load_calibration(str(path))


@pytest.mark.parametrize("utilization", [0.5, 0.7])
def test_single_prefill_server_matches_the_md1_queue(utilization: float) -> None:
    service = 0.1
    config = ClusterConfig(
        prefill=StepLatencyModel(service),
        decode=StepLatencyModel(0.01),
        max_num_batched_tokens=100,  # one 100-token prompt per step: one server, FCFS
    )
    workload = make_workload(20_000, utilization / service, prompt_len=100, output_len=1, seed=3)
    result = summarize_simulation(simulate(config, workload))
    expected_wait = utilization * service / (2 * (1 - utilization))
    assert result["completed"] == 20_000
    assert result["mean_ttft_ms"] == pytest.approx((service + expected_wait) * 1000, rel=0.05)


def test_decode_steps_follow_the_latency_model_exactly() -> None:
    prefill = StepLatencyModel(0.05, 1e-4)
    decode = StepLatencyModel(0.01, 1e-3, 1e-6)
    config = ClusterConfig(
        prefill=prefill, decode=decode, max_num_batched_tokens=1000, handoff_base_s=0.005
    )
    workload = Workload(arrivals=[0.0] * 4, prompt_lens=[100] * 4, output_lens=[5] * 4)
    requests = simulate(config, workload)
    prefill_time = prefill.predict(400, 4 * prefill_pairs(100))
    for request in requests:
        outcome = request.outcome()
        assert outcome.ttft == pytest.approx(prefill_time)
        # k tokens exist before decode step k: each of the 4 sequences attends 100 + k.
        steps = [decode.predict(4, 4 * (100 + k)) for k in range(1, 5)]
        assert outcome.itl == pytest.approx([0.005 + steps[0], *steps[1:]])
        assert outcome.output_tokens == 5


def test_colocated_prefill_slows_decode_more_than_disaggregation() -> None:
    prefill = StepLatencyModel(0.01, 5e-5)
    decode = StepLatencyModel(0.01, 2e-4)
    workload = make_workload(300, 8.0, prompt_len=1000, output_len=50, seed=5)
    colocated = ClusterConfig(
        prefill, decode, num_prefill=2, colocated=True, max_num_batched_tokens=512
    )
    split = ClusterConfig(prefill, decode, num_prefill=1, num_decode=1, max_num_batched_tokens=512)
    together = summarize_simulation(simulate(colocated, workload))
    apart = summarize_simulation(simulate(split, workload))
    assert together["completed"] == apart["completed"] == 300
    assert apart["median_itl_ms"] == pytest.approx(decode.predict(1, 0) * 1000, rel=0.5)
    assert together["p95_itl_ms"] > 1.5 * apart["p95_itl_ms"]
    for key in ("request_throughput", "output_throughput", "mean_tpot_ms", "p99_e2el_ms"):
        assert key in together


def test_placement_search_gives_the_bottleneck_phase_more_instances() -> None:
    calibration = {1: Calibration(StepLatencyModel(0.005, 1e-4), StepLatencyModel(0.005, 5e-5))}
    base = ClusterConfig(calibration[1].prefill, calibration[1].decode, max_num_batched_tokens=2048)
    prefill_heavy = SearchSpec(
        prompt_len=2000,
        output_len=4,
        ttft_slo_ms=1000,
        tpot_slo_ms=100,
        num_requests=150,
        max_gpus=3,
    )
    ranked = search_placements(base, calibration, prefill_heavy)
    best_split = next(row for row in ranked if not row["colocated"])
    assert (best_split["prefill_instances"], best_split["decode_instances"]) == (2, 1)
    assert ranked[0]["goodput_per_gpu"] >= ranked[-1]["goodput_per_gpu"]
    assert all(row["gpus"] <= 3 for row in ranked)
    assert {row["deployment"] for row in ranked} >= {"1P+1D x TP1", "3 colocated x TP1"}
