"""What `/health` says besides its status code: each instance as the global scheduler
sees it, and what degrades the service while it still serves.

A decode instance whose KV pulls keep failing still answers every request (under
`--kv-failure-policy recompute` it computes each prompt again), so it is no reason for a
503; but a service that computes every prompt twice is not "ok" either. It shows as
`"status": "degraded"`, a line in `warnings` naming the instance, and its entry's
`kv_pulls` (the gauge `pdserve:kv_pull_recompute_ratio` has the same share).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.common.messages import InstanceStats
from pdserve.gateway.routing import InstanceView

# A decode instance recomputes (rather than had a failed pull) once at least this share
# of its latest handoffs was recomputed there.
RECOMPUTING_SHARE = 0.5


def recompute_ratio(stats: InstanceStats) -> float:
    """The share of the instance's latest handoffs recomputed because the pull failed."""
    if not stats.kv_pulls_recent:
        return 0.0
    return stats.kv_pulls_recomputed / stats.kv_pulls_recent


def recomputing(stats: InstanceStats) -> bool:
    return stats.kv_pulls_recomputed > 0 and recompute_ratio(stats) >= RECOMPUTING_SHARE


def instance_entry(view: InstanceView) -> dict[str, Any]:
    """The instance (alive, load, and which kernels it runs, so a missing fast path
    shows). A dead instance's load is gone with it: its last numbers would read as work
    nobody carries."""
    entry: dict[str, Any] = {
        "id": view.instance_id,
        "role": view.role,
        "alive": view.alive,
        "epoch": view.epoch,
        "kernels": view.info.kernels,
    }
    if not view.alive:
        return entry
    stats = view.stats
    entry["num_running"] = stats.num_running
    entry["num_waiting"] = stats.num_waiting
    entry["kv_cache_usage_perc"] = stats.kv_cache_usage_perc
    if view.role == "decode":
        entry["kv_pulls"] = {
            "recent": stats.kv_pulls_recent,
            "recomputed": stats.kv_pulls_recomputed,
            "recomputing": recomputing(stats),
            "last_failure": stats.kv_pull_last_failure,
        }
    return entry


def warnings(views: Iterable[InstanceView]) -> list[str]:
    """One line per live instance that serves degraded."""
    lines = []
    for view in views:
        stats = view.stats
        if view.alive and view.role == "decode" and recomputing(stats):
            lines.append(
                f"decode instance {view.instance_id} recomputed {stats.kv_pulls_recomputed} "
                f"of its last {stats.kv_pulls_recent} handoffs because their KV pull failed "
                f"(latest: {stats.kv_pull_last_failure})"
            )
    return lines


def health_body(views: Iterable[InstanceView]) -> dict[str, Any]:
    views = list(views)
    lines = warnings(views)
    return {
        "status": "degraded" if lines else "ok",
        "warnings": lines,
        "instances": [instance_entry(view) for view in views],
    }
