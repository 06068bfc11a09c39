"""Transfer counters of one worker, shaped for Prometheus deltas.

Metric names: kv_transfer_bytes_total,
kv_transfer_seconds (histogram), kv_transfer_failures_total, plus lease expiries
and the in-flight gauge. Counters only grow; `since(earlier)` gives the delta an
instance ships with its step output.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_NUM_BUCKETS = len(SECONDS_BUCKETS) + 1  # the last one is +Inf


@dataclass
class KVTransferStats:
    bytes_total: int = 0  # KV bytes moved: sent on a prefill side, received on a decode side
    transfers_total: int = 0  # completed pulls (decode) / served pulls (prefill)
    failures_total: int = 0  # pulls that failed or timed out
    lease_expiries_total: int = 0  # prefill: leases that ran out before the decode side was done
    in_flight: int = 0  # gauge: transfers with data moving now
    # kv_transfer_seconds: per-bucket counts (the last one is +Inf), sum and count.
    seconds_bucket_counts: list[int] = field(default_factory=lambda: [0] * _NUM_BUCKETS)
    seconds_sum: float = 0.0
    seconds_count: int = 0

    def observe_seconds(self, seconds: float) -> None:
        self.seconds_bucket_counts[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
        self.seconds_sum += seconds
        self.seconds_count += 1

    def copy(self) -> KVTransferStats:
        return replace(self, seconds_bucket_counts=list(self.seconds_bucket_counts))

    def since(self, earlier: KVTransferStats) -> KVTransferStats:
        """Counter deltas from `earlier` to now; the gauge keeps its current value."""
        return KVTransferStats(
            bytes_total=self.bytes_total - earlier.bytes_total,
            transfers_total=self.transfers_total - earlier.transfers_total,
            failures_total=self.failures_total - earlier.failures_total,
            lease_expiries_total=self.lease_expiries_total - earlier.lease_expiries_total,
            in_flight=self.in_flight,
            seconds_bucket_counts=[
                a - b
                for a, b in zip(
                    self.seconds_bucket_counts, earlier.seconds_bucket_counts, strict=True
                )
            ],
            seconds_sum=self.seconds_sum - earlier.seconds_sum,
            seconds_count=self.seconds_count - earlier.seconds_count,
        )
