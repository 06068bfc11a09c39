"""What the prefill and decode kinds share: a KV transfer worker beside the engine.

`KVInstanceRuntime` starts one `KVTransferWorker` (kvtransfer/) over the engine's KV
storage once the weights are loaded, and adds to the shared step loop:
- transfer metrics: the worker's `KVTransferStats` deltas go out with each output as
  `kv_transfer_bytes_total`, `kv_transfers_total`, `kv_transfer_failures_total`,
  `kv_transfer_lease_expiries_total` and the `kv_transfer_seconds` histogram; an
  output is sent whenever they moved, even with no token to report;
- short task waits while a transfer is open (a held request on P, a pull on D), so
  reports are acted on within milliseconds instead of at the next idle timeout;
- deferred tasks: a request id still in use by an earlier attempt here (its blocks
  out on loan) is admitted once that attempt's transfer has ended.

Kinds (prefill/, decode/) override `start_transfers()` to build their scheduler half
and `retry_deferred(task)` to admit a task that had to wait.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from pdserve.instance.loop import InstanceRuntime, error_delta
from pdserve.kvtransfer import (
    SECONDS_BUCKETS,
    KVLayout,
    KVTransferConfig,
    KVTransferStats,
    KVTransferWorker,
    layout_of,
)
from pdserve.scheduler.messages import InstanceInfo, InstanceStats, MetricsDelta, RequestDelta

logger = logging.getLogger(__name__)

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


class KVInstanceRuntime(InstanceRuntime):
    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.kv_config = KVTransferConfig(
            instance_id=spec.instance_id,
            transport=spec.kv_transport,
            host=spec.host,
            **spec.kv_transfer,
        )
        self.worker: KVTransferWorker | None = None
        self.layout: KVLayout | None = None
        self._stats_sent = KVTransferStats()
        self._deferred: list[tuple[float, Any]] = []
        self._pending_deltas: list[RequestDelta] = []
        self._news = False

    # ---- lifecycle --------------------------------------------------------------------

    def load(self) -> InstanceInfo:
        super().load()
        engine = self._require_engine()
        self.layout = layout_of(engine.kv_cache.shape)
        self.worker = KVTransferWorker(self.kv_config, engine.kv_cache.storage, self.layout)
        self.worker.start()
        # The handshake endpoint shows in the instance's address (gateway, debugging).
        self.io.address = msgspec.structs.replace(
            self.io.address, kv_address=self.worker.control_address
        )
        self.start_transfers()
        return self.info()

    def start_transfers(self) -> None:
        """Builds the kind's scheduler half; `self.worker` and `self.layout` are set."""

    def on_close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def require_worker(self) -> KVTransferWorker:
        if self.worker is None:
            raise RuntimeError("the instance is not loaded yet: call load() first")
        return self.worker

    # ---- the loop ---------------------------------------------------------------------

    def task_wait_s(self) -> float:
        scheduler = self._require_engine().scheduler
        if scheduler.running:
            return 0.0
        if scheduler.waiting or self.transfers_open():
            return TRANSFER_POLL_S  # waiting for blocks, a pull or a release
        return self.spec.idle_wait_s

    def transfers_open(self) -> bool:
        scheduler = self._require_engine().scheduler
        return bool(
            scheduler.waiting_for_remote
            or scheduler.held
            or scheduler.quarantined
            or self._deferred
        )

    def has_news(self) -> bool:
        news, self._news = self._news, False
        if news or self._pending_deltas:
            return True
        stats = self.require_worker().stats()
        return stats.transfers_total != self._stats_sent.transfers_total or (
            stats.failures_total != self._stats_sent.failures_total
            or stats.lease_expiries_total != self._stats_sent.lease_expiries_total
        )

    def mark_news(self) -> None:
        """Something changed that the gateway should hear about this turn."""
        self._news = True

    def emit(self, delta: RequestDelta) -> None:
        """Queues a delta made outside a step (e.g. a failed handoff) for this turn."""
        self._pending_deltas.append(delta)

    def take_pending_deltas(self) -> list[RequestDelta]:
        deltas, self._pending_deltas = self._pending_deltas, []
        return deltas

    # ---- deferred tasks ---------------------------------------------------------------

    def defer(self, task: Any) -> None:
        """Admit `task` later: its request id is still held by an earlier attempt."""
        deadline = time.monotonic() + self.kv_config.lease_s + DEFER_MARGIN_S
        self._deferred.append((deadline, task))

    def drop_deferred(self, request_id: str) -> None:
        self._deferred = [(d, t) for d, t in self._deferred if t.request_id != request_id]

    def retry_deferred_tasks(self) -> None:
        waiting, self._deferred = self._deferred, []
        now = time.monotonic()
        for deadline, task in waiting:
            if not self.id_in_use(task.request_id):
                self.retry_deferred(task)
            elif now < deadline:
                self._deferred.append((deadline, task))
            else:
                message = f"request id {task.request_id} is still in use on this instance"
                self.emit(error_delta(task.request_id, message, len(task.prompt_token_ids)))

    def id_in_use(self, request_id: str) -> bool:
        scheduler = self._require_engine().scheduler
        return request_id in scheduler.requests or request_id in scheduler.quarantined

    def retry_deferred(self, task: Any) -> None:
        """Admits a task that was deferred (the kind's own admission path)."""
        raise NotImplementedError

    # ---- metrics ----------------------------------------------------------------------

    def stats(self) -> InstanceStats:
        stats = super().stats()
        if self.worker is not None:
            stats.num_kv_transfers_in_flight = self.worker.stats().in_flight
        return stats

    def collect_metrics(self, metrics: MetricsDelta) -> None:
        now = self.require_worker().stats()
        delta = now.since(self._stats_sent)
        self._stats_sent = now
        counters = dict(metrics.counters)
        for name, field in _COUNTERS.items():
            value = getattr(delta, field)
            if value:
                counters[name] = float(value)
        counters.update(self.kind_counters())
        metrics.counters = {k: v for k, v in counters.items() if v}
        seconds = transfer_observations(delta)
        if seconds:
            metrics.histograms = {**metrics.histograms, "kv_transfer_seconds": seconds}

    def kind_counters(self) -> dict[str, float]:
        """Counter increments of the kind since the last output."""
        return {}


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
