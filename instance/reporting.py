"""What an instance reports besides tokens: load stats for routing, metric deltas, and
its books for the idle invariant."""

from __future__ import annotations

from pdserve.common.messages import (
    InstanceInspection,
    InstanceStats,
    MetricsDelta,
    RequestDelta,
)
from pdserve.common.request import PhaseTimes
from pdserve.engine.core import EngineCore
from pdserve.scheduler.step_scheduler import Scheduler

# PhaseTimes field -> the histogram it is observed in (vLLM's names).
PHASE_HISTOGRAMS = {
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds",
}


def instance_stats(scheduler: Scheduler) -> InstanceStats:
    s = scheduler.stats()
    bm = scheduler.block_manager
    return InstanceStats(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_waiting_for_remote_kvs=s.num_waiting_for_remote_kvs,
        num_held=s.num_held,
        queued_prefill_tokens=queued_prefill_tokens(scheduler),
        num_free_blocks=bm.num_free_blocks,
        num_total_blocks=bm.num_blocks,
        kv_cache_usage_perc=s.kv_cache_usage_perc,
        num_preemptions_total=s.num_preemptions_total,
        prefix_cache_queries_total=s.prefix_cache_queries_total,
        prefix_cache_hits_total=s.prefix_cache_hits_total,
    )


def queued_prefill_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens still to compute: waiting requests and running ones mid-prefill."""
    waiting = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
    running = sum(
        r.num_prompt_tokens - r.num_computed_tokens
        for r in scheduler.running
        if r.num_computed_tokens < r.num_prompt_tokens
    )
    return waiting + running


def inspect_scheduler(scheduler: Scheduler, query_id: str) -> InstanceInspection:
    try:
        scheduler.check_invariants()
        error = None
    except AssertionError as exc:
        error = str(exc) or "an invariant failed"
    bm = scheduler.block_manager
    return InstanceInspection(
        query_id=query_id,
        invariant_error=error,
        block_owners={b: sorted(owners) for b, owners in bm.owners().items()},
        num_total_blocks=bm.num_blocks,
        num_free_blocks=bm.num_free_blocks,
        num_cached_blocks=bm.pool.num_cached_blocks,
        # quarantined: ended, but a transfer may still touch their blocks
        unfinished_request_ids=sorted({*scheduler.requests, *scheduler.quarantined}),
    )


class CounterBaseline:
    """The engine's cumulative counters at the last output, to ship deltas."""

    def __init__(self, values: dict[str, float] | None = None) -> None:
        self.values = values or {}

    @classmethod
    def of(cls, engine: EngineCore) -> CounterBaseline:
        return cls(_cumulative(engine))

    def advance(self, engine: EngineCore, deltas: list[RequestDelta]) -> MetricsDelta:
        now = _cumulative(engine)
        counters = {k: v - self.values.get(k, 0.0) for k, v in now.items()}
        self.values = now
        counters["generation_tokens_total"] = float(sum(len(d.new_token_ids) for d in deltas))
        counters["prompt_tokens_total"] = float(
            sum(d.num_prompt_tokens for d in deltas if d.output_index == 0 and d.new_token_ids)
        )
        return MetricsDelta(
            counters={k: v for k, v in counters.items() if v},
            histograms=phase_observations(engine.scheduler.take_phase_times()),
        )


def phase_observations(times: list[PhaseTimes]) -> dict[str, list[float]]:
    """Each request's phase durations, measured here when it left this instance: the
    prefill instance of a disaggregated request ships queue and prefill, the decode
    instance decode, a colocated one all three (see `Request.phase_times`)."""
    observed: dict[str, list[float]] = {}
    for t in times:
        for field, name in PHASE_HISTOGRAMS.items():
            seconds = getattr(t, field)
            if seconds is not None:
                observed.setdefault(name, []).append(max(0.0, seconds))
    return observed


def _cumulative(engine: EngineCore) -> dict[str, float]:
    stats = engine.scheduler.stats()
    return {
        "num_preemptions_total": float(stats.num_preemptions_total),
        "prefix_cache_queries_total": float(stats.prefix_cache_queries_total),
        "prefix_cache_hits_total": float(stats.prefix_cache_hits_total),
        "prompt_tokens_computed_total": float(engine.stats.prompt_tokens_computed),
    }
