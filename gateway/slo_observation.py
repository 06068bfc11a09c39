"""What the SLO controller sees each interval: both pools from the gateway's books, the
traffic's samples, and whether an operator's change is under way."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from pdserve.gateway.slo_policy import Observation, PoolObservation
from pdserve.gateway.slo_samples import MAX_ARRIVALS

if TYPE_CHECKING:
    from pdserve.gateway.gateway import Gateway
    from pdserve.gateway.routing import InstanceView

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


class SloObserver:
    """Reads the gateway's books (`GlobalScheduler` views fed by heartbeats, the pools'
    members, `SloSamples`); `own`: the instances the controller's own moves change,
    which are no operator's."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def observe(self, at: float, interval_s: float, own: Collection[str]) -> Observation:
        """The interval's observation; the traffic's samples start anew."""
        dropped = self.gateway.slo_samples.arrivals_dropped
        if dropped:  # the forecast's rate reads low this interval
            logger.warning(
                "SLO controller: %d arrivals past the interval's %d", dropped, MAX_ARRIVALS
            )
        ttft_ms, itl_ms, arrivals = self.gateway.slo_samples.take()
        return Observation(
            at=at,
            interval_s=interval_s,
            prefill=self.pool("prefill"),
            decode=self.pool("decode"),
            ttft_ms=ttft_ms,
            itl_ms=itl_ms,
            arrivals=arrivals,
            operator_change=self.operator_change(own),
        )

    def pool(self, role: str) -> PoolObservation:
        serving = self.gateway.scheduler.live((role,))
        usage = [v.stats.kv_cache_usage_perc for v in serving]
        return PoolObservation(
            serving=len(serving),
            starting=self.starting(role),
            queued=sum(v.stats.num_waiting for v in serving),
            running=sum(v.stats.num_running for v in serving),
            kv_usage=sum(usage) / len(usage) if usage else 0.0,
        )

    def starting(self, role: str) -> int:
        """Members loading or restarting, and instances of the other pool switching into
        this one (a member that drains is switching: a drained one is no member)."""
        control, views = self.gateway.pools, self.gateway.scheduler.views
        if control is None:
            return 0
        loading = [i for i in control.members(role) if not _alive(views.get(i))]
        other = POOLS[1 - POOLS.index(role)]
        switching = [
            i
            for i in control.members(other)
            if (view := views.get(i)) is not None and view.alive and view.draining
        ]
        return len(loading) + len(switching)

    def operator_change(self, own: Collection[str]) -> bool:
        """An admin drain or switch holds an instance's claim, or an admin scale-up's
        instance is loading (a member the gateway never saw), and no move of ours."""
        control, views = self.gateway.pools, self.gateway.scheduler.views
        if control is None:
            return False
        members = {i for role in POOLS for i in control.members(role)}
        if any(self.gateway.claims.busy(i) for i in (members | set(views)) - set(own)):
            return True
        return any(i not in views for i in members - set(own))

    def stale(self, now: float, limit_s: float) -> list[str]:
        """Serving instances the gateway has not heard from within `limit_s`."""
        live = self.gateway.scheduler.live(POOLS)
        return sorted(v.instance_id for v in live if now - v.last_seen > limit_s)


def _alive(view: InstanceView | None) -> bool:
    return view is not None and view.alive
