"""Validate the serving simulator against our own server on this machine.

    python -m experiments.validate_sim                      # 1P+1D and colocated, 30/60/90%
    python -m experiments.validate_sim --modes colocated --num-prompts 16 --loads 0.5

For each mode, one `pdserve serve --launcher local` (1 prefill + 1 decode instance, or
as many colocated instances), each instance with `--threads-per-instance` torch
threads, and then:
1. calibration from the server itself (`pdserve.planner.sim.server_calibration`): prefill and
   decode step models, the front end's cost, and for 1P+1D the handoff;
2. saturation: `--saturation-prompts` requests sent at once; completed requests/s;
3. `pdserve bench serve` with Poisson arrivals at each `--loads` fraction of that
   rate (random token-id prompts, answers run to their length);
4. the simulator on the same arrivals and lengths with the calibrated models;
and prints measured against predicted TTFT and ITL medians and p95s, their ratios and
a pass/fail (medians within 25%, p95s within 40%). `--offline-calibration` adds the
predictions of models fitted offline (`bench calibrate` through `pdserve.LLM`, same
threads and token budget, no serving path) for comparison.

The machine is shared: before anything runs, the script waits (up to `--load-wait-s`)
for the 1-minute load average to drop below `--max-load`, and it reports the share of
the cores other processes took while each mode was measured. Every run's JSON, the
calibrations and a summary land in `--out-dir`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from experiments.machine_load import CpuAccount, wait_for_quiet
from experiments.pd_vs_colocated import Server
from experiments.server_runs import add_server_flags, local_serve_args, run_bench_serve
from pdserve.planner.sim.compare import (
    Tolerances,
    compare,
    format_table,
    predict,
    tally,
    workload_of,
)
from pdserve.planner.sim.latency import Calibration, calibration_from_measurements
from pdserve.planner.sim.server_calibration import ProbePlan, calibrate_server_sync
from pdserve.planner.sim.simulator import ClusterConfig

MODES = ("disaggregated", "colocated")


def serve_args(args: argparse.Namespace, mode: str) -> list[str]:
    common = local_serve_args(args)
    if mode == "disaggregated":
        return [*common, "--num-prefill", "1", "--num-decode", "1",
                "--kv-transport", args.kv_transport]  # fmt: skip
    return [*common, "--mode", "colocated", "--num-colocated", str(args.num_colocated)]


def bench_serve(url: str, args: argparse.Namespace, out: Path, rate: str, count: int,
                seed: int) -> dict:  # fmt: skip
    """One `pdserve bench serve` run in its own process; its saved JSON."""
    result, _ = run_bench_serve(
        url, args, out, rate, count, seed, "--dataset-name", "random", "--request-timeout", "900"
    )
    if result["failed"]:
        raise RuntimeError(f"bench serve: {result['failed']} requests failed: {result['errors']}")
    return result


def probe_plan(args: argparse.Namespace, mode: str) -> ProbePlan:
    budget = args.max_num_batched_tokens
    return ProbePlan(
        prefill_lens=tuple(n for n in (32, 128, 256, 448) if n <= budget) or (budget,),
        decode_batches=tuple(args.decode_batches),
        decode_prompt_len=args.input_len,
        decode_output_len=max(args.output_len, 12),
        decode_instances=1 if mode == "disaggregated" else args.num_colocated,
        disaggregated=mode == "disaggregated",
        seed=args.seed + 1000,
    )


def cluster_config(args: argparse.Namespace, mode: str, calibration: dict) -> ClusterConfig:
    fitted = calibration_from_measurements(calibration)
    handoff = calibration.get("handoff") or {}
    colocated = mode == "colocated"
    return ClusterConfig(
        prefill=fitted.prefill,
        decode=fitted.decode,
        num_prefill=args.num_colocated if colocated else 1,
        num_decode=1,
        colocated=colocated,
        max_num_batched_tokens=args.max_num_batched_tokens,
        handoff_base_s=float(handoff.get("base_s", 0.0)),
        handoff_per_token_s=float(handoff.get("per_token_s", 0.0)),
    )


def describe(calibration: Calibration, handoff: dict | None) -> str:
    p, d = calibration.prefill, calibration.decode
    text = (
        f"prefill {p.intercept_s * 1e3:.1f} ms + {p.per_token_s * 1e3:.3f} ms/token "
        f"+ {p.per_pair_s * 1e9:.2f} ns/pair; decode {d.intercept_s * 1e3:.1f} ms + "
        f"{d.per_token_s * 1e3:.2f} ms/seq + {d.per_pair_s * 1e9:.1f} ns/pair"
    )
    if handoff:
        text += (
            f"; handoff {handoff['base_s'] * 1e3:.1f} ms + "
            f"{handoff['per_token_s'] * 1e6:.1f} us/token"
        )
    return text


def measure_mode(args: argparse.Namespace, mode: str, out: Path) -> dict:
    """Calibrate, saturate and run every load on one server; measured results only."""
    account = CpuAccount.start()
    with Server(serve_args(args, mode), out / f"server-{mode}.log") as server:
        started = time.time()
        calibration = calibrate_server_sync(
            server.url, probe_plan(args, mode), args.max_num_batched_tokens
        )
        (out / f"calibration-{mode}.json").write_text(json.dumps(calibration, indent=2) + "\n")
        print(f"{mode}: calibrated in {time.time() - started:.0f} s: "
              f"{describe(calibration_from_measurements(calibration), calibration['handoff'])}",
              flush=True)  # fmt: skip
        saturation = bench_serve(server.url, args, out / f"saturation-{mode}.json", "inf",
                                 args.saturation_prompts, args.seed + 500)  # fmt: skip
        rate = saturation["request_throughput"]
        print(f"{mode}: saturation {rate:.3f} req/s", flush=True)
        runs = []
        for index, load in enumerate(args.loads):
            seed = args.seed + index
            text = f"{load * rate:.6f}"
            result = bench_serve(server.url, args, out / f"{mode}-{load}.json", text,
                                 args.num_prompts, seed)  # fmt: skip
            runs.append({"load": load, "rate": float(text), "seed": seed, "result": result})
            print(f"{mode} {load:.0%}: TTFT p50 {result['median_ttft_ms']:.0f} ms, "
                  f"ITL p50 {result['median_itl_ms']:.0f} ms", flush=True)  # fmt: skip
    return {"calibration": calibration, "saturation": rate, "runs": runs, "cpu": account.stop()}


def offline_calibration(args: argparse.Namespace) -> dict:
    """Step models of the engine alone, fitted as `pdserve bench calibrate` does."""
    from pdserve.planner.sim.calibration import collect_step_samples

    budget = args.max_num_batched_tokens
    data = collect_step_samples(
        None, dtype=args.dtype, prompt_lens=tuple(n for n in (32, 128, 448) if n <= budget),
        batch_sizes=(1, 4, 8), decode_tokens=16, repeats=1, seed=args.seed,
        num_threads=args.threads_per_instance, max_num_batched_tokens=budget,
        kv_cache_memory=512 << 20,
    )  # fmt: skip
    data["handoff"] = {"base_s": 0.0, "per_token_s": 0.0}
    return data


def compare_mode(args: argparse.Namespace, mode: str, measured: dict, calibration: dict,
                 label: str) -> list[dict]:  # fmt: skip
    config = cluster_config(args, mode, calibration)
    tolerances = Tolerances(args.median_tolerance, args.p95_tolerance)
    rows = []
    for run in measured["runs"]:
        predicted = predict(config, workload_of(run["result"], run["seed"]))
        rows.append(
            {
                "mode": mode if label == "server" else f"{mode} ({label})",
                "load": run["load"],
                "rate": run["rate"],
                "figures": compare(run["result"], predicted, tolerances),
                "predicted": {k: v for k, v in predicted.items() if k.endswith("_ms")},
            }
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.validate_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--loads", type=float, nargs="+", default=[0.3, 0.6, 0.9])
    parser.add_argument("--num-prompts", type=int, default=24, help="per mode and load")
    parser.add_argument("--saturation-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--range-ratio", type=float, default=0.25)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--num-colocated", type=int, default=2, help="colocated instances")
    add_server_flags(
        parser, kv_cache_memory="512MiB", max_model_len=1024, max_num_batched_tokens=512
    )
    parser.add_argument("--median-tolerance", type=float, default=0.25)
    parser.add_argument("--p95-tolerance", type=float, default=0.40)
    parser.add_argument("--offline-calibration", action="store_true",
                        help="also predict with step models of the engine alone")  # fmt: skip
    parser.add_argument("--max-load", type=float, default=1.0,
                        help="wait for a 1-minute load average below (inf: don't)")  # fmt: skip
    parser.add_argument("--load-wait-s", type=float, default=1200.0)
    parser.add_argument("--load-poll-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="default: a new temporary folder")
    return parser.parse_args(argv)


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # stop the server and the running benchmark on the way out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="validate-sim-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        load = wait_for_quiet(args.max_load, args.load_wait_s, args.load_poll_s)
    except TimeoutError as exc:
        print(f"validate_sim: {exc}", file=sys.stderr)
        return 3
    print(f"load average {load:.2f}: measuring", flush=True)
    offline = offline_calibration(args) if args.offline_calibration else None
    rows, summary = [], {"argv": sys.argv[1:] if argv is None else argv, "modes": {}}
    for mode in args.modes:
        measured = measure_mode(args, mode, out)
        summary["modes"][mode] = {k: v for k, v in measured.items() if k != "runs"}
        rows += compare_mode(args, mode, measured, measured["calibration"], "server")
        if offline is not None:
            rows += compare_mode(args, mode, measured, offline, "offline")
        cpu = measured["cpu"]
        print(f"{mode}: {cpu['wall_s']:.0f} s; load average {cpu['load_average_start']:.2f} -> "
              f"{cpu['load_average_end']:.2f}; other processes took "
              f"{cpu['others_cpu_share']:.0%} of the cores, this run "
              f"{cpu['own_cpu_share']:.0%}", flush=True)  # fmt: skip
    summary["rows"] = [
        {**{k: v for k, v in row.items() if k != "figures"},
         "figures": [vars(f) | {"ratio": f.ratio, "passed": f.passed} for f in row["figures"]]}
        for row in rows
    ]  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("cells: measured / predicted (predicted/measured, within tolerance?)")
    print(format_table(rows))
    print(tally(rows))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
