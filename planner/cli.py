"""`pdserve plan` and `pdserve bench calibrate`: flags and handlers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.bench.cli import from_flags, guarded, int_list, positive_int
from pdserve.common.named_values import named_values
from pdserve.planner.capacity import LoadProfile, PhaseThroughput, throughput_from_sweep
from pdserve.planner.cost import CostInputs
from pdserve.planner.memory import DTYPE_BYTES, KV_DTYPES, MemoryInputs
from pdserve.planner.model_config import ModelShape, checkpoint_parameter_count, load_config
from pdserve.planner.report import PlanRequest, build_plan
from pdserve.planner.sim.calibration import CalibrationUnavailable, collect_step_samples
from pdserve.planner.sim.latency import calibration_from_measurements, load_calibration
from pdserve.planner.tables import format_plan


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and memory")
    model.add_argument("--model", required=True, help="checkpoint folder or config.json")
    model.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_BYTES])
    model.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_DTYPES])
    model.add_argument("--max-model-len", type=int, default=None)
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--max-num-batched-tokens", type=int, default=8192)
    model.add_argument("--gpu-memory-gib", type=float, default=80.0)
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    model.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="default: the smallest TP that fits --max-num-seqs",
    )
    load = parser.add_argument_group("load profile")
    load.add_argument("--requests-per-minute", type=float, default=None, help="at peak")
    load.add_argument("--prompt-tokens", type=float, default=None, help="mean per request")
    load.add_argument("--output-tokens", type=float, default=None, help="mean per request")
    load.add_argument("--ttft-slo-ms", type=float, default=None)
    load.add_argument("--itl-slo-ms", type=float, default=None)
    speed = parser.add_argument_group("per-GPU throughput (one source)")
    speed.add_argument("--prefill-tokens-per-s", type=float, default=None)
    speed.add_argument("--decode-tokens-per-s", type=float, default=None)
    speed.add_argument("--from-sweep", default=None, help="JSON written by `bench sweep`")
    speed.add_argument(
        "--calibration",
        action="append",
        default=[],
        help="step-time calibration JSON (one per TP size); enables simulation",
    )
    parser.add_argument("--target-utilization", type=float, nargs="+", default=[0.65, 0.70])
    cost = parser.add_argument_group("cost")
    cost.add_argument("--gpu-hourly-price", type=float, default=None)
    cost.add_argument("--api-input-price", type=float, default=None, help="$ per 1M tokens")
    cost.add_argument("--api-output-price", type=float, default=None, help="$ per 1M tokens")
    cost.add_argument("--hours-per-day", type=float, default=24.0)
    cost.add_argument("--days-per-year", type=float, default=365.0)
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--simulate-requests", type=int, default=500)
    sim.add_argument(
        "--search-max-gpus",
        type=int,
        default=None,
        help="also search P:D splits and TP within this many GPUs",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print every figure as JSON")


def load_profile(args: argparse.Namespace) -> LoadProfile | None:
    fields = (args.requests_per_minute, args.prompt_tokens, args.output_tokens)
    if all(f is None for f in fields):
        return None
    if any(f is None for f in fields):
        raise ValueError(
            "a load profile needs --requests-per-minute, --prompt-tokens and "
            "--output-tokens together"
        )
    return LoadProfile(*fields, ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms)


def phase_throughput(args: argparse.Namespace) -> PhaseThroughput | None:
    given = (args.prefill_tokens_per_s, args.decode_tokens_per_s)
    if args.from_sweep and any(v is not None for v in given):
        raise ValueError("use either --from-sweep or --prefill/--decode-tokens-per-s")
    if args.from_sweep:
        try:
            sweep = json.loads(Path(args.from_sweep).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"sweep file not found: {args.from_sweep}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{args.from_sweep}: invalid JSON ({exc.msg})") from None
        return throughput_from_sweep(sweep)
    if all(v is None for v in given):
        return None
    if any(v is None for v in given):
        raise ValueError("give both --prefill-tokens-per-s and --decode-tokens-per-s")
    return PhaseThroughput(*given)


def plan_request(args: argparse.Namespace) -> PlanRequest:
    shape = ModelShape.from_config(load_config(args.model))
    memory = from_flags(MemoryInputs, args)
    costs = None
    if args.gpu_hourly_price is not None:
        costs = CostInputs(
            args.gpu_hourly_price,
            args.hours_per_day,
            args.days_per_year,
            args.api_input_price,
            args.api_output_price,
        )
        costs.validate()
    calibrations = {}
    for path in args.calibration:
        calibration = load_calibration(path)
        calibrations[calibration.tp] = calibration
    if calibrations and 1 not in calibrations and args.tensor_parallel_size not in calibrations:
        raise ValueError("give a TP=1 calibration, or one for --tensor-parallel-size")
    return from_flags(
        PlanRequest,
        args,
        shape=shape,
        memory=memory,
        load=load_profile(args),
        throughput=phase_throughput(args),
        target_utilizations=args.target_utilization,
        tp=args.tensor_parallel_size,
        costs=costs,
        calibrations=calibrations,
    )


def run_plan(args: argparse.Namespace) -> int:
    plan = build_plan(plan_request(args))
    checkpoint = checkpoint_parameter_count(args.model)
    plan["memory"]["parameters_in_checkpoint"] = checkpoint
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(format_plan(plan))
        if checkpoint is not None:
            print(f"(checkpoint holds {checkpoint / 1e9:.3f} B parameters)")
    return 0


# `collect_step_samples`' arguments, each from the `bench calibrate` flag of its name.
CALIBRATE_FLAGS = (
    "model",
    "dtype",
    "prompt_lens",
    "batch_sizes",
    "decode_tokens",
    "repeats",
    "seed",
    "num_threads",
    "max_num_batched_tokens",
)


def run_calibrate(args: argparse.Namespace) -> int:
    data = collect_step_samples(**named_values(args, CALIBRATE_FLAGS))
    fitted = calibration_from_measurements(data)
    data["fitted"] = fitted.to_json()
    Path(args.output).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(data["fitted"], indent=2))
    print(f"saved {args.output}")
    return 0


def add_calibrate_parser(bench_sub) -> None:
    parser = bench_sub.add_parser(
        "calibrate", help="measure step times of the pdserve engine for the simulator"
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded one)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-lens", type=int_list, default=[64, 256, 1024])
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16])
    parser.add_argument("--decode-tokens", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=2)
    # A served instance computes with its share of the cores (`pdserve serve` gives each
    # max(1, cores // instances) threads) and the server's token budget: match them.
    parser.add_argument(
        "--num-threads", type=positive_int, default=None, help="torch threads (default: all)"
    )
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="calibration.json")
    parser.set_defaults(
        handler=guarded("bench calibrate", run_calibrate, (CalibrationUnavailable,))
    )


def add_plan_parser(subparsers) -> None:
    """`pdserve plan`: memory, capacity, cost and simulation for a deployment."""
    parser = subparsers.add_parser("plan", help="size and price a deployment")
    add_plan_arguments(parser)
    parser.set_defaults(handler=guarded("plan", run_plan))
