"""An instance's end of its ranks' KV connectors: what the prefill and decode roles share.

The roles plan transfers with their scheduler half (`PrefillKVScheduler`,
`DecodeKVScheduler`); the ranks' transfer workers sit behind the executor seam. The
link carries the metadata there and the ranks' reports back (merged so a request is
reported once every rank is done with it), and keeps what both roles need around that:
- transfer metrics: the ranks' counter deltas go out with each output as
  `kv_transfer_bytes_total`, `kv_transfers_total`, `kv_transfer_failures_total`,
  `kv_transfer_lease_expiries_total`, the `kv_transfer_seconds` histogram and each
  rank's bytes (`MetricsDelta.rank_kv_bytes`); an
  output is sent whenever they moved, even with no token to report;
- short task waits while a transfer is open, so reports are acted on within
  milliseconds instead of at the next idle timeout;
- deferred tasks: a request id still in use by an earlier attempt (its blocks out on
  loan) is admitted once that attempt's transfer has ended, or ends in an error delta;
- deltas made outside a step (a rejected handoff, a failed pull), sent this turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdserve.common.messages import InstanceStats, MetricsDelta, RequestDelta, error_delta
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector import RankReport
from pdserve.kvtransfer.messages import KVConnectorMetadata, KVLayout, TransferReport
from pdserve.kvtransfer.metrics import SECONDS_BUCKETS, KVTransferStats
from pdserve.kvtransfer.reports import ReportAggregator
from pdserve.scheduler.step_scheduler import Scheduler

# How long a loop turn waits for tasks while transfers are open: reports (a pull
# done, a lease out) are acted on this fast. Small against a model step.
TRANSFER_POLL_S = 0.005
# A deferred task waits at most this long past the lease for its id to come free.
DEFER_MARGIN_S = 5.0

_COUNTERS = {
    "kv_transfer_bytes_total": "bytes_total",
    "kv_transfers_total": "transfers_total",
    "kv_transfer_failures_total": "failures_total",
    "kv_transfer_lease_expiries_total": "lease_expiries_total",
}

Exchange = Callable[[KVConnectorMetadata], list[Any]]
# Takes a task in (ValueError: it cannot run here); may return a delta to send.
Admit = Callable[[Any], RequestDelta | None]


class KVLink:
    def __init__(
        self,
        config: KVTransferConfig,
        layout: KVLayout,
        rank_addresses: list[str],
        exchange: Exchange,
    ) -> None:
        """`exchange(metadata)`: hands the ranks their metadata without a model step and
        returns their `RankReport`s (the engine's `exchange_kv`)."""
        self.config = config
        self.layout = layout
        self.rank_addresses = rank_addresses
        self._exchange = exchange
        self._aggregator = ReportAggregator(len(rank_addresses))
        self.stats = KVTransferStats()  # the ranks' counters at their last report, summed
        self._stats_sent = KVTransferStats()
        self.rank_bytes = [0] * len(rank_addresses)  # each rank's bytes at its last report
        self._rank_bytes_sent = [0] * len(rank_addresses)
        self._deferred: list[tuple[float, Any]] = []
        self._pending: list[RequestDelta] = []
        self._news = False

    @property
    def tp_size(self) -> int:
        """Ranks per pipeline stage (the addresses are every stage's ranks)."""
        return len(self.rank_addresses) // self.layout.pipeline_parallel_size

    # ---- reports ----------------------------------------------------------------------

    def exchange(self, metadata: KVConnectorMetadata) -> TransferReport:
        return self.absorb(self._exchange(metadata))

    def absorb(self, reports: list[RankReport]) -> TransferReport:
        """Merges the ranks' reports of one executor call (one per rank)."""
        for rank, rank_report in enumerate(reports):
            self._aggregator.add(rank, rank_report.report)
        if reports:
            self.stats = sum_stats([r.stats for r in reports])
            self.rank_bytes = [r.stats.bytes_total for r in reports]
        return self._aggregator.pop()

    # ---- the loop ---------------------------------------------------------------------

    def transfers_open(self, scheduler: Scheduler) -> bool:
        return bool(
            scheduler.waiting_for_remote
            or scheduler.held
            or scheduler.quarantined
            or self._deferred
        )

    def task_wait_s(self, scheduler: Scheduler, idle_wait_s: float, busy: bool = False) -> float:
        """`busy`: the role has transfer work of its own the scheduler does not see."""
        if scheduler.running:
            return 0.0
        if scheduler.waiting or busy or self.transfers_open(scheduler):
            return TRANSFER_POLL_S  # waiting for blocks, a pull or a release
        return idle_wait_s

    def mark_news(self) -> None:
        """Something changed that the gateway should hear about this turn."""
        self._news = True

    def emit(self, delta: RequestDelta) -> None:
        """Queues a delta made outside a step (e.g. a failed handoff) for this turn."""
        self._pending.append(delta)

    def take_pending_deltas(self) -> list[RequestDelta]:
        deltas, self._pending = self._pending, []
        return deltas

    def has_news(self) -> bool:
        news, self._news = self._news, False
        if news or self._pending:
            return True
        now, sent = self.stats, self._stats_sent
        return (now.transfers_total, now.failures_total, now.lease_expiries_total) != (
            sent.transfers_total,
            sent.failures_total,
            sent.lease_expiries_total,
        )

    # ---- deferred tasks ---------------------------------------------------------------

    def defer(self, task: Any) -> None:
        """Admit `task` later: its request id is still held by an earlier attempt."""
        deadline = time.monotonic() + self.config.lease_s + DEFER_MARGIN_S
        self._deferred.append((deadline, task))

    def deferred_ids(self) -> set[str]:
        return {task.request_id for _, task in self._deferred}

    def drop_deferred(self, request_id: str) -> None:
        self._deferred = [(d, t) for d, t in self._deferred if t.request_id != request_id]

    def take_admissible(self, id_in_use: Callable[[str], bool]) -> list[Any]:
        """Deferred tasks whose id came free; those that waited too long end in error."""
        waiting, self._deferred = self._deferred, []
        now = time.monotonic()
        ready = []
        for deadline, task in waiting:
            if not id_in_use(task.request_id):
                ready.append(task)
            elif now < deadline:
                self._deferred.append((deadline, task))
            else:
                message = f"request id {task.request_id} is still in use on this instance"
                self.emit(error_delta(task.request_id, message, len(task.prompt_token_ids)))
        return ready

    def admit_deferred(self, id_in_use: Callable[[str], bool], admit: Admit) -> None:
        """Admits the deferred tasks whose id came free; what they answer, or the error
        one could not run with, goes out this turn."""
        for task in self.take_admissible(id_in_use):
            try:
                delta = admit(task)
            except ValueError as exc:
                delta = error_delta(task.request_id, str(exc), len(task.prompt_token_ids))
            if delta is not None:
                self.emit(delta)

    # ---- metrics ----------------------------------------------------------------------

    def add_stats(self, stats: InstanceStats) -> None:
        stats.num_kv_transfers_in_flight = self.stats.in_flight

    def add_metrics(self, metrics: MetricsDelta, role_counters: dict[str, float]) -> None:
        delta = self.stats.since(self._stats_sent)
        self._stats_sent = self.stats.copy()
        counters = dict(metrics.counters)
        for name, field in _COUNTERS.items():
            value = getattr(delta, field)
            if value:
                counters[name] = float(value)
        counters.update(role_counters)
        metrics.counters = {k: v for k, v in counters.items() if v}
        moved = {
            rank: float(now - sent)
            for rank, (now, sent) in enumerate(
                zip(self.rank_bytes, self._rank_bytes_sent, strict=True)
            )
            if now > sent
        }
        self._rank_bytes_sent = list(self.rank_bytes)
        if moved:
            metrics.rank_kv_bytes = moved
        seconds = transfer_observations(delta)
        if seconds:
            metrics.histograms = {**metrics.histograms, "kv_transfer_seconds": seconds}


def sum_stats(stats: list[KVTransferStats]) -> KVTransferStats:
    total = KVTransferStats()
    for s in stats:
        total.bytes_total += s.bytes_total
        total.transfers_total += s.transfers_total
        total.failures_total += s.failures_total
        total.lease_expiries_total += s.lease_expiries_total
        total.in_flight += s.in_flight
        total.seconds_bucket_counts = [
            a + b for a, b in zip(total.seconds_bucket_counts, s.seconds_bucket_counts, strict=True)
        ]
        total.seconds_sum += s.seconds_sum
        total.seconds_count += s.seconds_count
    return total


def transfer_observations(delta: KVTransferStats) -> list[float]:
    """Observations that reproduce a histogram delta in the gateway's histogram (the
    same buckets): exact with one transfer, bucket-exact with more (each bucket's
    share gets the delta's mean, clamped into that bucket)."""
    if delta.seconds_count <= 0:
        return []
    if delta.seconds_count == 1:
        return [delta.seconds_sum]
    mean = delta.seconds_sum / delta.seconds_count
    values = []
    bounds = (0.0, *SECONDS_BUCKETS)
    for index, count in enumerate(delta.seconds_bucket_counts):
        if count <= 0:
            continue
        low = bounds[index]
        high = SECONDS_BUCKETS[index] if index < len(SECONDS_BUCKETS) else float("inf")
        value = min(max(mean, low), high)
        if value == low and index > 0:
            value = low * 1.0001  # buckets are (low, high]: stay inside
        values.extend([value] * count)
    return values
