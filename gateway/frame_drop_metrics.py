"""`pdserve:dropped_frames_total{channel,reason}`: the gateway's and its instances' drops."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.common.frame_drops import FrameDrops
from pdserve.common.messages import DroppedFrames

NAME = "pdserve:dropped_frames"
DOC = (
    "Frames dropped before they were used: too large, malformed, a bad or replayed "
    "seal, sealed under another name, or undecodable (by channel and reason)"
)


class DroppedFrameSeries(Collector):
    """Read at each scrape: the gateway's own book (`own`, which its sealers count in,
    apart from the process's, which in-process instances ship) plus what instances
    reported."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.own = FrameDrops()
        self._reported: dict[tuple[str, str], int] = {}
        registry.register(self)

    def add(self, drops: list[DroppedFrames]) -> None:
        """Counts an instance shipped with an output (increments since its previous)."""
        for drop in drops:
            key = (drop.channel, drop.reason)
            self._reported[key] = self._reported.get(key, 0) + drop.count

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(NAME, DOC, labels=("channel", "reason"))
        totals = dict(self._reported)
        for key, count in self.own.totals().items():
            totals[key] = totals.get(key, 0) + count
        for (channel, reason), count in sorted(totals.items()):
            family.add_metric((channel, reason), count)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(NAME, DOC, labels=("channel", "reason"))
