"""Builds `/metrics` series: one registry and one name prefix for a family of series."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "pdserve:"


class SeriesBuilder:
    """Makes counters, gauges and histograms in one registry, each named `prefix` + the
    name given, with its help text and label names (none by default)."""

    def __init__(self, registry: CollectorRegistry, prefix: str = PREFIX) -> None:
        self.registry = registry
        self.prefix = prefix

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        # prometheus_client appends "_total" itself: a name ending in it loses it here.
        return Counter(
            self.prefix + name.removesuffix("_total"),
            documentation,
            labels,
            registry=self.registry,
        )

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self.prefix + name, documentation, labels, registry=self.registry)

    def histogram(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
    ) -> Histogram:
        return Histogram(
            self.prefix + name, documentation, labels, buckets=buckets, registry=self.registry
        )
