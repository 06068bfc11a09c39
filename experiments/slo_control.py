"""The SLO controller against every fixed P:D split of an instance budget, on one phased trace.

    python -m experiments.slo_control --simulate --instances 32
    python -m experiments.slo_control --simulate --instances 128
    python -m experiments.slo_control --real --instances 4 --scale 0.5

`--simulate` replays `experiments/slo_trace.py`'s trace in the elastic simulator
(`pdserve.planner.sim.elastic`) once per fixed split of the budget and once under
`SloPolicy` (the gateway's policy, fed Observations built from the simulated pools), and
prints per phase and overall: goodput (requests meeting both SLOs per second), SLO
attainment, TTFT and ITL p50/p99, failed requests and decisions taken. The last two lines
are `failed requests: N` (the controller's run) and the controller's goodput over the
best fixed split's. The step-latency model is the calibration shipped beside this script
(`slo_calibration.json`: the step models `experiments.validate_sim` calibrated through a
1P+1D server of the embedded model on a quiet 2-core machine, as `BENCHMARKS.md` records
them) unless `--calibration` names another (`pdserve bench calibrate`'s JSON).

`--real` replays the trace against real servers on this machine instead
(`experiments/slo_real.py`): `--instances` local instances of the embedded model, one
thread each, once per fixed split and once under `--autoscale slo` (calibrated by
`slo_calibration_real.json` unless `--calibration` says otherwise), and prints the same
tables plus the simulator's prediction of the controller run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from experiments.slo_real import real_runs
from experiments.slo_sim import SimRun, SimSetup, run_controlled, run_fixed
from experiments.slo_trace import TraceRequest, phase_windows, phased_trace
from pdserve.gateway.slo_policy import PolicyConfig
from pdserve.planner.sim.latency import load_calibration

CALIBRATION = Path(__file__).with_name("slo_calibration.json")
# `--real`'s: step times of one of four one-thread instances time-sharing two cores.
REAL_CALIBRATION = Path(__file__).with_name("slo_calibration_real.json")
# The trace's SLOs, fixed with it: a RAG prompt computes in about 8.2 s on the shipped
# CPU calibration and a lone decode step in about 70 ms.
TTFT_SLO_MS = 20000.0
ITL_SLO_MS = 150.0
# The chat phase's requests/s per instance of the budget: each phase then loads about
# 75-90% of the budget at its own best split, where one compromise split cannot serve all.
RATE_PER_INSTANCE = 0.625
# The same for real servers on this 2-core machine, where the budget's instances share
# the two cores (time-shared, they step slower than the calibration's lone instance).
REAL_RATE_PER_INSTANCE = 0.2


def percentile(values: np.ndarray, q: float, weights: np.ndarray | None = None) -> float:
    if values.size == 0:
        return float("nan")
    if weights is None:
        return float(np.percentile(values, q))
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    at = np.searchsorted(cumulative, q / 100.0 * cumulative[-1])
    return float(values[order][min(at, values.size - 1)])


def phase_figures(run: SimRun, name: str, start: float, end: float) -> dict:
    jobs = [j for j, phase in zip(run.jobs, run.phases, strict=True) if name in ("all", phase)]
    done = [j for j in jobs if j.finish is not None]
    ttft = np.array([(j.first_token or 0.0) - j.arrival for j in done]) * 1e3
    good = sum(
        1
        for j in done
        if (j.first_token or 0.0) - j.arrival <= TTFT_SLO_MS / 1e3
        and (j.tpot() or 0.0) <= ITL_SLO_MS / 1e3
    )
    ends, gaps, batches = run.steps
    in_window = (ends >= start) & (ends < end)
    itl = gaps[in_window] * 1e3
    moves = [d for d in run.decisions if d.action != "hold" and start <= d.at < end]
    return {
        "phase": name,
        "requests": len(jobs),
        "goodput": good / max(end - start, 1e-9),
        "attainment": good / len(jobs) if jobs else float("nan"),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50, batches[in_window]),
        "itl_p99": percentile(itl, 99, batches[in_window]),
        "failed": len(jobs) - len(done),
        "decisions": len(moves),
    }


def run_figures(run: SimRun, scale: float) -> list[dict]:
    windows = phase_windows(scale)
    rows = [phase_figures(run, name, start, end) for name, start, end in windows]
    # Overall: the whole trace's span, and steps until the last request finished.
    rows.append(phase_figures(run, "all", 0.0, windows[-1][2]))
    rows[-1]["itl_p50"], rows[-1]["itl_p99"] = (
        percentile(run.steps[1] * 1e3, q, run.steps[2]) for q in (50, 99)
    )
    return rows


def phase_oracle(fixed: list[tuple[list[dict], SimRun]], scale: float) -> tuple[float, str]:
    """Goodput of the best fixed split in each phase, as if switching at phase boundaries
    cost nothing, and those splits: a reference for what moving the split can gain. (Each
    phase's figures are those of a run that served the earlier phases at that split.)"""
    total, labels = 0.0, []
    for index, (name, start, end) in enumerate(phase_windows(scale)):
        rows, run = max(fixed, key=lambda item: item[0][index]["goodput"])
        total += rows[index]["goodput"] * (end - start)
        labels.append(f"{name} {run.label}")
    return total / phase_windows(scale)[-1][2], ", ".join(labels)


def format_rows(label: str, rows: list[dict]) -> str:
    lines = [
        f"{label}:",
        "  phase   reqs  goodput/s  attain  TTFT p50/p99 ms     ITL p50/p99 ms  failed  moves",
    ]
    for r in rows:
        lines.append(
            f"  {r['phase']:<6} {r['requests']:>5} {r['goodput']:>10.3f} {r['attainment']:>7.1%}"
            f"  {r['ttft_p50']:>8.0f}/{r['ttft_p99']:<8.0f}"
            f"  {r['itl_p50']:>6.0f}/{r['itl_p99']:<7.0f} {r['failed']:>7} {r['decisions']:>6}"
        )
    return "\n".join(lines)


def fixed_runs(
    setup: SimSetup, budget: int, trace: list[TraceRequest], args: argparse.Namespace
) -> list[tuple[list[dict], SimRun]]:
    """Every fixed split; with `--split-step K`, every Kth and then all near the best of those."""
    done: dict[int, tuple[list[dict], SimRun]] = {}

    def run(prefills: range | list[int]) -> None:
        for prefill in prefills:
            if 1 <= prefill < budget and prefill not in done:
                result = run_fixed(setup, prefill, budget - prefill, trace)
                done[prefill] = (run_figures(result, args.scale), result)

    step = args.split_step
    run([*range(1, budget, step), budget - 1])
    if step > 1:
        best = max(done, key=lambda p: done[p][0][-1]["goodput"])
        run(range(best - step + 1, best + step))
    return [done[p] for p in sorted(done)]


def trace_policy(
    budget: int, interval_s: float, cooldown_intervals: int, persist_intervals: int = 2
) -> PolicyConfig:
    """The controller's settings for `budget` instances under the trace's SLOs."""
    return PolicyConfig(
        budget,
        TTFT_SLO_MS,
        ITL_SLO_MS,
        interval_s=interval_s,
        cooldown_intervals=cooldown_intervals,
        persist_intervals=persist_intervals,
    )


def simulate(args: argparse.Namespace) -> int:
    calibration = load_calibration(str(args.calibration))
    budget = args.instances
    policy = trace_policy(budget, args.interval, args.cooldown_intervals, args.persist_intervals)
    setup = SimSetup(calibration, policy, switch_delay_s=args.switch_delay)
    rate = args.rate if args.rate is not None else RATE_PER_INSTANCE * budget
    trace = phased_trace(args.seed, args.scale, rate)
    print(
        f"budget {budget} instances, chat rate {rate:.2f} req/s, {len(trace)} requests, "
        f"SLOs TTFT {TTFT_SLO_MS:.0f} ms / ITL {ITL_SLO_MS:.0f} ms, interval {args.interval} s"
    )
    started = time.monotonic()
    fixed = fixed_runs(setup, budget, trace, args)
    fixed_s = time.monotonic() - started
    best_rows, best = max(fixed, key=lambda item: item[0][-1]["goodput"])
    ranked = sorted(fixed, key=lambda item: -item[0][-1]["goodput"])
    print(
        "fixed splits, best first: "
        + ", ".join(f"{run.label} {rows[-1]['goodput']:.3f}/s" for rows, run in ranked[:8])
    )
    started = time.monotonic()
    controlled = run_controlled(setup, budget // 2, trace)
    controller_s = time.monotonic() - started
    controller_rows = run_figures(controlled, args.scale)
    print(format_rows(f"best fixed split {best.label}", best_rows))
    print(format_rows(f"controller (from {budget // 2}P+{budget - budget // 2}D)", controller_rows))
    splits = " ".join(f"{at:.0f}s:{p}P+{d}D" for at, p, d in controlled.splits[:: args.trace_every])
    print(f"controller's split over time: {splits}")
    print(
        f"simulated {len(fixed)} fixed splits in {fixed_s:.1f} s, "
        f"the controller in {controller_s:.1f} s"
    )
    best_goodput = best_rows[-1]["goodput"]
    ratio = controller_rows[-1]["goodput"] / best_goodput if best_goodput > 0 else float("inf")
    oracle, splits = phase_oracle(fixed, args.scale)
    over = controller_rows[-1]["goodput"] / oracle if oracle > 0 else float("inf")
    print(
        f"the best fixed split of each phase, switched for free between phases: {oracle:.3f}/s "
        f"({splits}); controller / that: {over:.2f}"
    )
    print(f"failed requests: {controller_rows[-1]['failed']}")
    print(f"controller goodput / best fixed split: {ratio:.2f}")
    return 0


def serve_flags(args: argparse.Namespace) -> list[str]:
    """What every real run's server shares: the model, threads, cache and lengths."""
    return [
        "--launcher", "local", "--threads-per-instance", "1", "--dtype", "bfloat16",
        "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2560",
    ]  # fmt: skip


def controller_flags(args: argparse.Namespace) -> list[str]:
    """What the controller's run adds: its SLOs, calibration and interval."""
    return [
        "--autoscale", "slo", "--instance-budget", str(args.instances),
        "--autoscale-interval-s", str(args.interval), "--ttft-slo-ms", str(TTFT_SLO_MS),
        "--itl-slo-ms", str(ITL_SLO_MS), "--calibration", str(args.calibration),
    ]  # fmt: skip


def real(args: argparse.Namespace) -> int:
    rate = args.rate if args.rate is not None else REAL_RATE_PER_INSTANCE * args.instances
    trace = phased_trace(args.seed, args.scale, rate)
    args.ttft_slo_ms, args.itl_slo_ms = TTFT_SLO_MS, ITL_SLO_MS
    print(
        f"real servers: budget {args.instances} instances, chat rate {rate:.2f} req/s, "
        f"{len(trace)} requests, SLOs TTFT {TTFT_SLO_MS:.0f} ms / ITL {ITL_SLO_MS:.0f} ms",
        flush=True,
    )
    started = time.monotonic()
    fixed, (controlled, decisions) = real_runs(
        args,
        trace,
        (serve_flags(args), controller_flags(args)),
        lambda label, rows: print(format_rows(label, rows), flush=True),
    )
    best_label, best_rows = max(fixed, key=lambda item: item[1][-1]["goodput"])
    moves = [f"{d['run_s']:.0f}s:{d['action']}({d['reason']})" for d in decisions]
    print("controller's moves: " + " ".join(m for m in moves if "hold" not in m))
    calibration = load_calibration(str(args.calibration))
    policy = trace_policy(args.instances, args.interval, args.cooldown_intervals)
    setup = SimSetup(calibration, policy, switch_delay_s=args.switch_delay)
    predicted = run_figures(run_controlled(setup, args.instances // 2, trace), args.scale)
    print(format_rows("the simulator's replay of the controller run", predicted))
    real_goodput, sim_goodput = controlled[-1]["goodput"], predicted[-1]["goodput"]
    print(f"simulated / real controller goodput: {sim_goodput / max(real_goodput, 1e-9):.2f}")
    for row, best in zip(controlled, best_rows, strict=True):
        ratio = row["goodput"] / best["goodput"] if best["goodput"] > 0 else float("inf")
        print(f"  {row['phase']:<6} controller / {best_label}: {ratio:.2f}")
    print(f"real runs took {time.monotonic() - started:.0f} s")
    ratio = controlled[-1]["goodput"] / max(best_rows[-1]["goodput"], 1e-9)
    print(f"failed requests: {controlled[-1]['failed']}")
    print(f"controller goodput / best fixed split: {ratio:.2f}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="replay in the simulator")
    parser.add_argument("--real", action="store_true", help="replay against real servers")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per instance (--real)")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="one real run (s)")
    parser.add_argument("--instances", type=int, default=32, help="the instance budget")
    parser.add_argument("--rate", type=float, default=None, help="chat phase requests/s")
    parser.add_argument("--scale", type=float, default=1.0, help="stretch the phases' lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=float, default=1.0, help="decision interval (s)")
    parser.add_argument("--cooldown-intervals", type=int, default=1)
    parser.add_argument("--persist-intervals", type=int, default=2)
    parser.add_argument("--switch-delay", type=float, default=0.5, help="role switch (s)")
    parser.add_argument(
        "--calibration", type=Path, default=None, help="default: the shipped one of the mode"
    )
    parser.add_argument(
        "--split-step",
        type=int,
        default=1,
        help="simulate every Kth fixed split, then all within K of the best (default: all)",
    )
    parser.add_argument("--trace-every", type=int, default=10, help="print every Nth split")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.instances < 2 or args.split_step < 1:
        print(
            "slo_control: --instances must be at least 2, --split-step at least 1", file=sys.stderr
        )
        return 2
    if args.calibration is None:
        args.calibration = REAL_CALIBRATION if args.real else CALIBRATION
    if args.simulate:
        try:
            return simulate(args)
        except ValueError as exc:
            print(f"slo_control: {exc}", file=sys.stderr)
            return 2
    if args.real:
        try:
            return real(args)
        except (ValueError, RuntimeError) as exc:
            print(f"slo_control: {exc}", file=sys.stderr)
            return 2
    print("slo_control: say --simulate or --real", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
