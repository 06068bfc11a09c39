"""Transfer histogram deltas become observations the gateway's histogram replays."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pdserve.gateway.metrics import TRANSFER_BUCKETS
from pdserve.kvtransfer import SECONDS_BUCKETS, KVTransferStats
from pdserve.kvtransfer.link import transfer_observations


def replay(values: list[float]) -> list[float]:
    registry = CollectorRegistry()
    histogram = Histogram("t", "t", buckets=TRANSFER_BUCKETS, registry=registry)
    for value in values:
        histogram.observe(value)
    samples = registry.collect().__next__().samples
    cumulative = [s.value for s in samples if s.name == "t_bucket"]
    return [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative, strict=True)]


def test_the_gateway_uses_the_transfer_buckets() -> None:
    assert tuple(TRANSFER_BUCKETS) == tuple(SECONDS_BUCKETS)


def test_one_transfer_is_replayed_exactly() -> None:
    earlier = KVTransferStats()
    now = earlier.copy()
    now.observe_seconds(0.0123)
    assert transfer_observations(now.since(earlier)) == [pytest.approx(0.0123)]
    assert transfer_observations(now.since(now)) == []


@pytest.mark.parametrize(
    "seconds",
    [[0.0001, 0.004, 0.004, 0.3, 7.0], [0.001, 0.0025, 0.005], [0.02, 0.02, 0.02]],
)
def test_several_transfers_land_in_the_same_buckets(seconds: list[float]) -> None:
    earlier = KVTransferStats()
    earlier.observe_seconds(1.0)  # before the delta: not replayed
    now = earlier.copy()
    for value in seconds:
        now.observe_seconds(value)
    delta = now.since(earlier)
    values = transfer_observations(delta)
    assert len(values) == len(seconds)
    assert replay(values) == [float(c) for c in delta.seconds_bucket_counts]
