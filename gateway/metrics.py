"""`/metrics`: Prometheus text built from instance outputs and the gateway's own timings.

Names are DESIGN.md's with the `pdserve:` prefix, labelled by `role` and `instance`.
Gauges take each instance's latest `InstanceStats`; counters and histograms add the
`MetricsDelta` every output carries (names as sent, e.g. "prompt_tokens_total"); the
gateway observes TTFT, inter-token latency and end-to-end latency itself, labelled by
the instance that produced the token (the prefill instance for the first one).
"""

from __future__ import annotations

import re

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from pdserve.scheduler.messages import InstanceOutput, InstanceStats

PREFIX = "pdserve:"
LABELS = ("role", "instance")
_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

GAUGES = {
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting to be scheduled",
    "num_requests_waiting_for_remote_kvs": "Requests pulling their KV from a prefill instance",
    "kv_transfers_in_flight": "KV transfers with data moving (served on prefill, pulled on decode)",
    "kv_cache_usage_perc": "Fraction of KV blocks in use (1 = full)",
    "instance_up": "1 while the gateway hears from the instance",
}
COUNTERS = {
    "num_preemptions_total": "Requests preempted for lack of KV blocks",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits_total": "Prompt tokens found in the prefix cache",
    "prompt_tokens_total": "Prompt tokens of requests whose prefill finished",
    "prompt_tokens_computed_total": "Prompt tokens run through the model (cache misses)",
    "generation_tokens_total": "Tokens generated",
    "kv_transfer_bytes_total": "KV bytes moved between instances",
    "kv_transfer_failures_total": "KV transfers that failed or timed out",
    "request_success_total": "Requests that finished, by the instance that ended them",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Arrival at the gateway to the first token", LATENCY_BUCKETS),
    "inter_token_latency_seconds": ("Gaps between streamed tokens", LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("Arrival at the gateway to the last token", LATENCY_BUCKETS),
    "kv_transfer_seconds": ("Duration of one KV pull", TRANSFER_BUCKETS),
}
_STAT_GAUGES = {
    "num_requests_running": lambda s: s.num_running,
    "num_requests_waiting": lambda s: s.num_waiting,
    "num_requests_waiting_for_remote_kvs": lambda s: s.num_waiting_for_remote_kvs,
    "kv_transfers_in_flight": lambda s: s.num_kv_transfers_in_flight,
    "kv_cache_usage_perc": lambda s: s.kv_cache_usage_perc,
}


class GatewayMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only double the page
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges = {
            n: Gauge(PREFIX + n, d, LABELS, registry=self.registry) for n, d in GAUGES.items()
        }
        self.counters = {n: self._counter(n, d) for n, d in COUNTERS.items()}
        self.histograms = {
            n: Histogram(PREFIX + n, d, LABELS, buckets=b, registry=self.registry)
            for n, (d, b) in HISTOGRAMS.items()
        }
        self.rejected = Counter(
            PREFIX + "num_requests_rejected",
            "Requests refused by admission control (503)",
            registry=self.registry,
        )
        self.retried = Counter(
            PREFIX + "num_requests_retried",
            "Requests sent again after their instance died before their first token",
            registry=self.registry,
        )

    def _counter(self, name: str, documentation: str) -> Counter:
        # prometheus_client appends "_total" itself.
        return Counter(
            PREFIX + name.removesuffix("_total"), documentation, LABELS, registry=self.registry
        )

    def add_instance(self, role: str, instance_id: str) -> None:
        """Every series of the instance shows from the start, at zero."""
        for metric in (*self.gauges.values(), *self.counters.values(), *self.histograms.values()):
            metric.labels(role, instance_id)
        self.gauges["instance_up"].labels(role, instance_id).set(1)

    def mark_down(self, role: str, instance_id: str) -> None:
        self.gauges["instance_up"].labels(role, instance_id).set(0)

    def record_output(self, output: InstanceOutput) -> None:
        role, instance = output.instance.role, output.instance.instance_id
        if output.stats is not None:
            self.record_stats(role, instance, output.stats)
        if output.metrics is None:
            return
        for name, value in output.metrics.counters.items():
            counter = self.counters.get(name) or self._dynamic_counter(name)
            if counter is not None and value > 0:
                counter.labels(role, instance).inc(value)
        for name, values in output.metrics.histograms.items():
            histogram = self.histograms.get(name) or self._dynamic_histogram(name)
            if histogram is not None:
                child = histogram.labels(role, instance)
                for value in values:
                    child.observe(value)

    def record_stats(self, role: str, instance: str, stats: InstanceStats) -> None:
        for name, read in _STAT_GAUGES.items():
            self.gauges[name].labels(role, instance).set(read(stats))

    def observe(self, name: str, role: str, instance: str, seconds: float) -> None:
        self.histograms[name].labels(role, instance).observe(seconds)

    def count(self, name: str, role: str, instance: str, value: float = 1.0) -> None:
        self.counters[name].labels(role, instance).inc(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _dynamic_counter(self, name: str) -> Counter | None:
        """A counter an instance kind sends that the gateway does not list (yet)."""
        if not _NAME.match(name):
            return None
        try:
            self.counters[name] = self._counter(name, f"{name} (reported by instances)")
        except ValueError:  # clashes with a series already registered
            return None
        return self.counters[name]

    def _dynamic_histogram(self, name: str) -> Histogram | None:
        if not _NAME.match(name):
            return None
        try:
            self.histograms[name] = Histogram(
                PREFIX + name, f"{name} (reported by instances)", LABELS, registry=self.registry
            )
        except ValueError:
            return None
        return self.histograms[name]
