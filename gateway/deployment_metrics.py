"""The deployment's settings and pool sizes as `/metrics` series: the thresholds the
alert rules (`deploy/prometheus/alerts.yaml`) compare live series against, so the
rules need no per-deployment editing.

- `pdserve:ttft_slo_seconds`: `pdserve serve --ttft-slo-ms`, absent without it (a
  gauge at 0 would read as an SLO every request misses);
- `pdserve:max_num_seqs{role, instance}`: each instance's running seats
  (`--max-num-seqs`), as the instance reported them when it registered;
- `pdserve:kv_cache_bytes_per_token{role, instance, kv_cache_dtype}`: the KV bytes one
  token takes on each instance (all its ranks), labelled by the cache's dtype
  (`--kv-cache-dtype`), as the instance reported them when it registered;
- `pdserve:pool_size{role}` and `pdserve:pool_instances_up{role}`: the instances a
  pool should have (planned at start, or set by `/admin/pools/{role}/scale`; drained
  ones leave it) and those of them loaded and heard from, read at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.gateway.series import PREFIX, SeriesBuilder


class PoolCount(msgspec.Struct, frozen=True):
    size: int  # the instances the pool should have
    up: int  # those of them loaded and alive


PoolReader = Callable[[], dict[str, PoolCount]]


class _PoolCollector(Collector):
    """Reads the pools when scraped: sizes change with scaling, draining and deaths,
    and a stored copy could lag behind any of them."""

    def __init__(self, read: PoolReader) -> None:
        self.read = read

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The names alone, for the registry's clash check (no pools read then)."""
        return self._families({})

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self._families(self.read())

    @staticmethod
    def _families(pools: dict[str, PoolCount]) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily(
            PREFIX + "pool_size",
            "Instances the pool should have: planned at start or set by "
            "/admin/pools/{role}/scale, drained ones not counted",
            labels=("role",),
        )
        up = GaugeMetricFamily(
            PREFIX + "pool_instances_up",
            "Instances of the pool loaded and heard from (pool_size when none is missing)",
            labels=("role",),
        )
        for role, count in sorted(pools.items()):
            size.add_metric((role,), count.size)
            up.add_metric((role,), count.up)
        yield size
        yield up


class DeploymentSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.series = SeriesBuilder(registry)
        self.max_num_seqs = self.series.gauge(
            "max_num_seqs",
            "Requests the instance runs at once (--max-num-seqs)",
            ("role", "instance"),
        )
        self.kv_bytes_per_token = Gauge(
            PREFIX + "kv_cache_bytes_per_token",
            "KV cache bytes one token takes on the instance, all its ranks (--kv-cache-dtype)",
            ("role", "instance", "kv_cache_dtype"),
            registry=registry,
        )
        self.ttft_slo: Gauge | None = None
        # What each instance's series were set to, so a role switch can move them.
        self._seats: dict[str, tuple[str, int]] = {}
        self._kv: dict[str, tuple[str, str, int]] = {}

    def set_ttft_slo(self, seconds: float) -> None:
        """Registered only once known, so a deployment without an SLO exports none."""
        if self.ttft_slo is None:
            self.ttft_slo = self.series.gauge(
                "ttft_slo_seconds", "The time-to-first-token objective (--ttft-slo-ms), in seconds"
            )
        self.ttft_slo.set(seconds)

    def set_max_num_seqs(self, role: str, instance: str, seats: int) -> None:
        self._seats[instance] = (role, seats)
        self.max_num_seqs.labels(role, instance).set(seats)

    def set_kv_cache(self, role: str, instance: str, dtype: str, bytes_per_token: int) -> None:
        self._kv[instance] = (role, dtype, bytes_per_token)
        self.kv_bytes_per_token.labels(role, instance, dtype).set(bytes_per_token)

    def move_instance(self, new: str, instance: str) -> None:
        """The instance switched role: its settings show under the new role only."""
        if (seats := self._seats.get(instance)) is not None:
            self.max_num_seqs.remove(seats[0], instance)
            self.set_max_num_seqs(new, instance, seats[1])
        if (kv := self._kv.get(instance)) is not None:
            self.kv_bytes_per_token.remove(kv[0], instance, kv[1])
            self.set_kv_cache(new, instance, kv[1], kv[2])

    def watch_pools(self, read: PoolReader) -> None:
        """`read`: each pool's size and live instances now (called at every scrape)."""
        self.registry.register(_PoolCollector(read))
