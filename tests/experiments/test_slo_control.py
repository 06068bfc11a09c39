"""The SLO-control comparison at a tiny scale: the controller follows the trace's phases."""

from __future__ import annotations

import pytest

from experiments import slo_control
from experiments.slo_sim import SimRun, SimSetup, run_controlled, run_fixed
from experiments.slo_trace import PHASES, phase_windows, phased_trace
from pdserve.planner.sim.latency import load_calibration

BUDGET = 8
SCALE = 0.25


@pytest.fixture(scope="module")
def setup() -> SimSetup:
    calibration = load_calibration(str(slo_control.CALIBRATION))
    return SimSetup(
        calibration, slo_control.trace_policy(BUDGET, interval_s=1.0, cooldown_intervals=1)
    )


@pytest.fixture(scope="module")
def trace():
    return phased_trace(seed=1, scale=SCALE, rate=slo_control.RATE_PER_INSTANCE * BUDGET)


def moves_in(run: SimRun, phase: str) -> list[str]:
    (start, end) = next((s, e) for name, s, e in phase_windows(SCALE) if name == phase)
    return [d.role_to or "" for d in run.decisions if d.action == "switch" and start <= d.at < end]


def test_the_trace_is_a_pure_function_of_its_arguments(trace) -> None:
    assert phased_trace(seed=1, scale=SCALE, rate=slo_control.RATE_PER_INSTANCE * BUDGET) == trace
    assert [p.name for p in PHASES] == ["chat", "rag", "mixed", "burst"]
    rag = [r for r in trace if r.phase == "rag"]
    chat = [r for r in trace if r.phase == "chat"]
    assert rag and all(1800 <= r.prompt_tokens <= 2200 and r.output_tokens <= 60 for r in rag)
    assert chat and all(r.prompt_tokens <= 300 and r.output_tokens >= 300 for r in chat)


def test_the_controller_grows_prefill_for_rag_and_decode_for_chat(setup, trace) -> None:
    # From a prefill-heavy start, chat wants decode; then RAG wants prefill back.
    run = run_controlled(setup, BUDGET - 1, trace)
    chat, rag = moves_in(run, "chat"), moves_in(run, "rag")
    assert chat and chat.count("decode") > chat.count("prefill"), chat
    assert rag and rag.count("prefill") > rag.count("decode"), rag
    assert all(j.finish is not None for j in run.jobs)
    assert all(p >= 1 and d >= 1 and p + d <= BUDGET for _, p, d in run.splits)


def test_the_report_ends_with_the_two_lines(setup, trace, capsys, monkeypatch) -> None:
    monkeypatch.setattr(slo_control, "phased_trace", lambda seed, scale, rate: trace)
    assert slo_control.main(["--simulate", "--instances", "4", "--scale", str(SCALE)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("the best fixed split of each phase, switched for free")
    assert lines[-2].startswith("failed requests: ")
    assert lines[-1].startswith("controller goodput / best fixed split: ")
    assert float(lines[-1].rsplit(" ", 1)[1]) > 0
    fixed = run_fixed(setup, 2, 2, trace)
    assert all(j.finish is not None for j in fixed.jobs)


def test_the_phase_oracle_takes_each_phase_from_its_best_split() -> None:
    windows = phase_windows(1.0)
    lengths = [end - start for _, start, end in windows]
    # Run A is best in chat, run B in the other phases.
    a = [{"goodput": g} for g in (10.0, 1.0, 1.0, 1.0)]
    b = [{"goodput": g} for g in (5.0, 2.0, 3.0, 4.0)]
    runs = [(a, SimRun("4P+4D", [], [], ())), (b, SimRun("6P+2D", [], [], ()))]  # type: ignore[arg-type]
    oracle, labels = slo_control.phase_oracle(runs, 1.0)
    expected = sum(g * t for g, t in zip((10.0, 2.0, 3.0, 4.0), lengths, strict=True))
    assert oracle == pytest.approx(expected / windows[-1][2])
    assert labels == "chat 4P+4D, rag 6P+2D, mixed 6P+2D, burst 6P+2D"


def test_without_simulate_it_says_what_is_missing(capsys) -> None:
    assert slo_control.main(["--instances", "8"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
