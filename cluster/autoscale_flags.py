"""`pdserve serve`'s SLO controller flags (`--autoscale slo`), checked into the
gateway's typed `AutoscaleConfig`."""

from __future__ import annotations

import argparse
import math
from collections import Counter

from pdserve.cluster.placement import PlannedInstance
from pdserve.gateway.slo_controller import AutoscaleConfig, read_calibration
from pdserve.gateway.slo_policy import PolicyConfig

AUTOSCALE = ("off", "slo")
POOLS = ("prefill", "decode")
DEFAULT_INTERVAL_S = 5.0
# Flags that mean something only to the controller: given with --autoscale off they
# would be ignored, so they are refused.
CONTROLLER_FLAGS = (
    "instance_budget",
    "min_prefill",
    "max_prefill",
    "min_decode",
    "max_decode",
    "itl_slo_ms",
    "autoscale_interval_s",
    "calibration",
)


def add_autoscale_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--autoscale",
        choices=AUTOSCALE,
        default="off",
        help="slo: a controller in the gateway switches roles and starts or stops "
        "instances so TTFT and ITL meet --ttft-slo-ms and --itl-slo-ms, within "
        "--instance-budget (needs both SLOs and --calibration; not in --mode colocated)",
    )
    group.add_argument(
        "--instance-budget",
        type=int,
        default=None,
        metavar="N",
        help="the most prefill + decode instances the controller may run (default: the "
        "instances started)",
    )
    for role in ("prefill", "decode"):
        group.add_argument(
            f"--min-{role}",
            type=int,
            default=None,
            help=f"the fewest {role} instances (default: 1)",
        )
        group.add_argument(
            f"--max-{role}",
            type=int,
            default=None,
            help=f"the most {role} instances (default: what the budget and the pool's "
            "--max-pool-size allow)",
        )
    group.add_argument(
        "--itl-slo-ms",
        type=float,
        default=None,
        help="the inter-token latency objective the controller keeps (as `pdserve plan`'s)",
    )
    group.add_argument(
        "--autoscale-interval-s",
        type=float,
        default=None,
        help=f"seconds between the controller's decisions (default: {DEFAULT_INTERVAL_S:g})",
    )
    group.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="the step-latency measurements `pdserve bench calibrate` wrote (JSON)",
    )


def autoscale_config(
    args: argparse.Namespace, instances: list[PlannedInstance], pool_limits: dict[str, int]
) -> AutoscaleConfig | None:
    """The controller's settings (None: --autoscale off); ValueError (one line) for flags
    it cannot run with. `instances`: those started; `pool_limits`: each pool's
    --max-pool-size."""
    if args.autoscale == "off":
        given = [f for f in CONTROLLER_FLAGS if getattr(args, f) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ValueError(f"{flag} is the SLO controller's: it needs --autoscale slo")
        return None
    if args.mode == "colocated":
        raise ValueError("--autoscale slo needs prefill and decode pools (not --mode colocated)")
    for flag, value in (("--ttft-slo-ms", args.ttft_slo_ms), ("--itl-slo-ms", args.itl_slo_ms)):
        if value is None:
            raise ValueError(f"--autoscale slo needs {flag}")
        if not 0 < value < math.inf:
            raise ValueError(f"{flag} must be a positive number of milliseconds")
    if args.calibration is None:
        raise ValueError("--autoscale slo needs --calibration FILE (from pdserve bench calibrate)")
    policy = policy_config(args, dict(Counter(i.role for i in instances)), pool_limits)
    try:
        calibration = read_calibration(args.calibration)
    except ValueError as exc:
        raise ValueError(f"--calibration: {exc}") from None
    return AutoscaleConfig(policy, calibration)


def policy_config(
    args: argparse.Namespace, planned: dict[str, int], pool_limits: dict[str, int]
) -> PolicyConfig:
    """The budget, the pools' bounds and the interval, each checked in one line."""
    started = planned.get("prefill", 0) + planned.get("decode", 0)
    budget = started if args.instance_budget is None else args.instance_budget
    interval = (
        DEFAULT_INTERVAL_S if args.autoscale_interval_s is None else args.autoscale_interval_s
    )
    if not 0 < interval < math.inf:
        raise ValueError("--autoscale-interval-s must be a positive number of seconds")
    least = {role: _given(args, f"min_{role}", 1) for role in POOLS}
    for role in POOLS:
        limit, most = pool_limits.get(role), getattr(args, f"max_{role}")
        if least[role] < 1:
            raise ValueError(f"--min-{role} must be at least 1")
        if most is not None and limit is not None and most > limit:
            raise ValueError(f"--max-{role} {most} is above the pool's --max-pool-size {limit}")
        if most is not None and most < least[role]:
            raise ValueError(f"--max-{role} {most} is below --min-{role} {least[role]}")
    if budget < sum(least.values()):
        raise ValueError(
            f"--instance-budget {budget} is below --min-prefill + --min-decode "
            f"({sum(least.values())})"
        )
    if budget < started:
        raise ValueError(f"--instance-budget {budget} is below the {started} instances started")
    room = sum(pool_limits.get(role, budget) for role in POOLS)
    if budget > room:
        raise ValueError(
            f"--instance-budget {budget} is above what the pools may hold ({room}, --max-pool-size)"
        )
    most = {role: _most(args, role, budget - least[_other(role)], pool_limits) for role in POOLS}
    for role in POOLS:
        if not least[role] <= planned.get(role, 0) <= (most[role] or budget):
            raise ValueError(
                f"--num-{role} {planned.get(role, 0)} is outside --min-{role} {least[role]} "
                f"and --max-{role} {most[role] or budget}"
            )
    return PolicyConfig(
        instance_budget=budget,
        ttft_slo_ms=args.ttft_slo_ms,
        itl_slo_ms=args.itl_slo_ms,
        min_prefill=least["prefill"],
        max_prefill=most["prefill"],
        min_decode=least["decode"],
        max_decode=most["decode"],
        interval_s=interval,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )


def _given(args: argparse.Namespace, name: str, default: int) -> int:
    value = getattr(args, name)
    return default if value is None else int(value)


def _other(role: str) -> str:
    return POOLS[1 - POOLS.index(role)]


def _most(
    args: argparse.Namespace, role: str, room: int, pool_limits: dict[str, int]
) -> int | None:
    """`--max-ROLE`, else the pool's `--max-pool-size` where it is below what the budget
    leaves the pool (None: the budget alone bounds it)."""
    given = getattr(args, f"max_{role}")
    if given is not None:
        return int(given)
    limit = pool_limits.get(role)
    return limit if limit is not None and limit < room else None
