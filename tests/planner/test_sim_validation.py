"""The pieces of the simulator's validation: the decode handoff timing, calibration from
a server's probes, rebuilding a run's workload, the comparison, the machine-load gate."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from experiments.machine_load import CpuAccount, wait_for_quiet
from pdserve.bench.arrivals import arrival_offsets
from pdserve.planner.sim.compare import Tolerances, compare, format_table, tally, workload_of
from pdserve.planner.sim.latency import StepLatencyModel, prefill_pairs
from pdserve.planner.sim.server_calibration import (
    ProbePlan,
    calibrate_server_sync,
    fit_from_probes,
    steady_step_s,
)
from pdserve.planner.sim.simulator import ClusterConfig, Workload, simulate


def fixed_steps(prefill_s: float, max_num_batched_tokens: int, **more: float) -> ClusterConfig:
    """Steps of a fixed length (decode 1 s) and a 0.1 s handoff, plus `more` settings."""
    return ClusterConfig(
        prefill=StepLatencyModel(prefill_s),
        decode=StepLatencyModel(1.0),
        max_num_batched_tokens=max_num_batched_tokens,
        handoff_base_s=0.1,
        **more,
    )


def test_a_busy_decode_instance_pulls_between_steps() -> None:
    # Request 0 decodes alone in 1 s steps from 0.6 s; request 1's handoff arrives in
    # the middle of step 1.6-2.6 (its prefill ends at 2.5 s): the pull starts at the
    # boundary, step 2.6-3.6 runs without it, and its second token ends step 3.6-4.6.
    config = fixed_steps(prefill_s=0.5, max_num_batched_tokens=100)
    workload = Workload(arrivals=[0.0, 2.0], prompt_lens=[10, 10], output_lens=[10, 3])
    first, second = simulate(config, workload)
    # Idle decode instance: pull at once (0.5 -> 0.6), then steps of 1 s.
    assert first.token_times[:3] == pytest.approx([0.5, 1.6, 2.6])
    assert second.token_times == pytest.approx([2.5, 4.6, 5.6])
    # The same handoff behind an idle instance takes the pull and one step.
    alone = simulate(config, Workload([2.0], [10], [3]))[0]
    assert alone.token_times == pytest.approx([2.5, 3.6, 4.6])


def test_an_idle_decode_instance_steps_when_the_first_pull_is_done() -> None:
    # A handoff of 100 tokens takes 0.2 s, of 900 tokens 1.0 s.
    config = fixed_steps(prefill_s=0.1, max_num_batched_tokens=1000, handoff_per_token_s=0.001)
    short, long = simulate(config, Workload([0.0, 0.0], [100, 900], [2, 2]))
    assert short.token_times == pytest.approx([0.1, 1.3])  # pulled at 0.3, stepped alone
    assert long.token_times == pytest.approx([0.1, 2.3])  # ready at 1.1, joins at 1.3


def probe_records(prefill: StepLatencyModel, decode: StepLatencyModel, handoff_s: float):
    plan = ProbePlan(decode_prompt_len=64, decode_output_len=24)
    prefill_records = [
        {
            "prompt_len": n,
            "ttft_s": prefill.predict(n, prefill_pairs(n)),
            "first_gap_s": handoff_s + decode.predict(1, n + 1),
            "decode_gap_s": decode.predict(1, n + 2),
        }
        for n in plan.prefill_lens
        for _ in range(2)
    ]
    context = 64 + 13
    decode_records = [
        {"batch": b, "mean_context": context, "step_s": decode.predict(b, b * context)}
        for b in plan.decode_batches
    ]
    return plan, prefill_records, decode_records


def test_probe_records_fit_the_models_and_the_handoff() -> None:
    prefill = StepLatencyModel(0.05, 2e-3, 1e-8)
    decode = StepLatencyModel(0.03, 0.01)
    plan, prefill_records, decode_records = probe_records(prefill, decode, handoff_s=0.02)
    data = fit_from_probes(prefill_records, decode_records, plan)
    fitted = data["fitted"]["prefill_model"]
    assert fitted["intercept_s"] == pytest.approx(0.05, rel=1e-3)
    assert fitted["per_token_s"] == pytest.approx(2e-3, rel=1e-3)
    assert data["fitted"]["decode_model"]["intercept_s"] == pytest.approx(0.03, rel=1e-3)
    assert data["handoff"]["base_s"] == pytest.approx(0.02, abs=1e-4)
    assert data["handoff"]["per_token_s"] == pytest.approx(0.0, abs=1e-7)
    # Decode samples: one per batch probe, one per prefill probe's lone decode steps.
    assert len(data["decode"]) == len(plan.decode_batches) + len(prefill_records)
    # Colocated: no handoff, and each first gap is one more decode sample.
    colocated = ProbePlan(decode_prompt_len=64, decode_output_len=24, disaggregated=False)
    _, prefill_records, _ = probe_records(prefill, decode, handoff_s=0.0)
    data = fit_from_probes(prefill_records, decode_records, colocated)
    assert data["handoff"] == {"base_s": 0.0, "per_token_s": 0.0}
    assert len(data["decode"]) == len(plan.decode_batches) + 2 * len(prefill_records)


def test_a_stall_in_delivery_does_not_shorten_the_step() -> None:
    # Steps of 20 ms; a stall delivers three tokens at once after 80 ms (a median of the
    # steady gaps would say 0 ms).
    bunched = [0.5, 0.02, 0.02, 0.08, 0.0, 0.0, 0.0]
    steady = [0.5, 0.02] + [0.02] * 5
    assert steady_step_s([bunched]) == pytest.approx(0.02)
    assert steady_step_s([bunched, bunched, steady]) == pytest.approx(0.02)


def test_probes_must_fit_one_prefill_step() -> None:
    with pytest.raises(ValueError, match="must fit one step"):
        ProbePlan(prefill_lens=(32, 600)).validate(512)


@pytest.mark.slow
def test_calibration_from_a_server_recovers_its_latencies(scripted_server) -> None:
    # TTFT 300 ms at any prompt length; ITL 50 ms plus 25 ms per other request running.
    # Steps this long keep a late wake-up of a loaded 2-core machine (~10 ms) inside the
    # tolerance: a prefill probe's decode sample is the mean of two gaps.
    scripted_server.script(ttft_s=0.3, itl_s=0.05, itl_per_active_s=0.025)
    plan = ProbePlan(
        prefill_lens=(8, 64),
        prefill_repeats=2,
        decode_batches=(1, 4),
        decode_prompt_len=16,
        decode_output_len=8,
    )
    data = calibrate_server_sync(scripted_server.base_url, plan, max_num_batched_tokens=512)
    prefill = data["fitted"]["prefill_model"]
    decode = StepLatencyModel(**data["fitted"]["decode_model"])
    ttft = prefill["intercept_s"] + 64 * prefill["per_token_s"]
    assert ttft == pytest.approx(0.3, rel=0.15)
    context = data["probes"]["decode"][0]["mean_context"]
    assert decode.predict(1, context) == pytest.approx(0.05, rel=0.25)
    assert decode.predict(4, 4 * context) == pytest.approx(0.125, rel=0.25)
    # The scripted first gap is one ITL: what is left for the handoff is near zero.
    assert data["handoff"]["base_s"] < 0.025
    assert scripted_server.stats()["requests"] == 2 * 2 + 1 + 4


def bench_result(rate: float | str, input_lens: list[int], output_lens: list[int]) -> dict:
    return {
        "request_rate": rate,
        "burstiness": 1.0,
        "max_concurrency": None,
        "failed": 0,
        "input_lens": input_lens,
        "output_lens": output_lens,
    }


def test_workload_of_a_run_has_its_arrivals_and_lengths() -> None:
    result = bench_result(2.5, [10, 20, 30, 40], [5, 6, 7, 8])
    workload = workload_of(result, seed=7)
    assert workload.arrivals == pytest.approx(list(arrival_offsets(4, 2.5, 1.0, 7)))
    assert workload.arrivals[0] == 0.0 and np.all(np.diff(workload.arrivals) > 0)
    assert (workload.prompt_lens, workload.output_lens) == ([10, 20, 30, 40], [5, 6, 7, 8])
    assert workload_of(bench_result("inf", [1, 2], [1, 1]), seed=0).arrivals == [0.0, 0.0]
    with pytest.raises(ValueError, match="max-concurrency"):
        workload_of({**result, "max_concurrency": 4}, seed=7)


def test_comparison_judges_medians_and_p95s_apart() -> None:
    measured = {"median_ttft_ms": 100.0, "p95_ttft_ms": 200.0, "median_itl_ms": 50.0,
                "p95_itl_ms": 80.0}  # fmt: skip
    predicted = {"median_ttft_ms": 124.0, "p95_ttft_ms": 130.0, "median_itl_ms": 37.0,
                 "p95_itl_ms": 111.0}  # fmt: skip
    figures = compare(measured, predicted, Tolerances(0.25, 0.40))
    assert [f.label for f in figures] == ["TTFT p50", "TTFT p95", "ITL p50", "ITL p95"]
    assert [round(f.ratio, 3) for f in figures] == [1.24, 0.65, 0.74, 1.387]
    assert [f.passed for f in figures] == [True, True, False, True]
    rows = [{"mode": "colocated", "load": 0.6, "rate": 1.5, "figures": figures}]
    table = format_table(rows)
    assert "| colocated | 60% | 1.500 | 100 / 124 (1.24 ok) |" in table
    assert "50 / 37 (0.74 MISS)" in table
    assert tally(rows) == "3/4 figures within tolerance; misses: colocated 60% ITL p50 (0.74)"


def test_the_load_gate_waits_then_gives_up() -> None:
    assert wait_for_quiet(math.inf, timeout_s=0) >= 0
    logged: list[str] = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="load average stayed at or above 0"):
        wait_for_quiet(0.0, timeout_s=0.2, poll_s=0.1, log=logged.append)
    assert time.monotonic() - started < 2 and logged


def test_the_cpu_account_sees_our_own_work() -> None:
    account = CpuAccount.start()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    found = account.stop()
    assert found["own_cpu_share"] * found["wall_s"] * found["cores"] >= 0.25
    assert 0 <= found["others_cpu_share"] <= 1
