"""`/metrics`: Prometheus text built from instance outputs and the gateway's own timings.

Names carry the `pdserve:` prefix, labelled by `role` and `instance`.
Beside them every series vLLM's Grafana dashboard reads goes out under vLLM's name
(`vllm:*`, vLLM's buckets) with `model_name` added, so that dashboard works unchanged;
the disaggregation series get vLLM-style names too (`vllm:kv_transfer_*`).
Gauges take each instance's latest `InstanceStats`; counters and histograms add the
`MetricsDelta` every output carries (names as sent, e.g. "prompt_tokens_total"); the
gateway observes TTFT, inter-token latency and end-to-end latency itself, labelled by
the instance that produced the token (the prefill instance for the first one).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from pdserve.common.messages import InstanceOutput, InstanceStats
from pdserve.gateway.deployment_metrics import DeploymentSeries
from pdserve.gateway.frame_drop_metrics import DroppedFrameSeries
from pdserve.gateway.health import recompute_ratio
from pdserve.gateway.role_metrics import RoleSeries
from pdserve.gateway.series import SeriesBuilder
from pdserve.gateway.timeline import PHASES

LABELS = ("role", "instance")
S = TypeVar("S", Counter, Histogram)
_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

# Buckets from a second up, shared by pdserve's latencies and vLLM's inter-token latency.
_SECONDS = (1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, *_SECONDS)
# vLLM's buckets (vllm/v1/metrics/loggers.py), for its series and the per-request phases.
VLLM_TTFT_BUCKETS = (*LATENCY_BUCKETS, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, *_SECONDS)
_UNDER_A_MINUTE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
VLLM_REQUEST_BUCKETS = (*_UNDER_A_MINUTE, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

GAUGES = {
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting to be scheduled",
    "num_requests_waiting_for_remote_kvs": "Requests pulling their KV from a prefill instance",
    "kv_transfers_in_flight": "KV transfers with data moving (served on prefill, pulled on decode)",
    "kv_cache_usage_perc": "Fraction of KV blocks in use (1 = full)",
    "instance_up": "1 while the gateway hears from the instance",
    "kv_pull_recompute_ratio": "Share of the decode instance's latest handoffs (up to 32) "
    "recomputed there because their KV pull failed",
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
    # Per-request phases, measured on the instances (instance/reporting.py).
    "request_queue_time_seconds": ("Queued here until first scheduled", VLLM_REQUEST_BUCKETS),
    "request_prefill_time_seconds": ("First scheduled to first token", VLLM_REQUEST_BUCKETS),
    "request_decode_time_seconds": ("First token to last token", VLLM_REQUEST_BUCKETS),
}
VLLM_PREFIX = "vllm:"
VLLM_LABELS = ("model_name", *LABELS)
FINISHED_REASONS = ("stop", "length", "abort")  # shown at zero from the start, as in vLLM
# Counters kept under the same name in both namespaces (names as instances send them).
VLLM_COUNTERS = (
    "prompt_tokens_total",
    "generation_tokens_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "kv_transfer_bytes_total",
    "kv_transfer_failures_total",
    "kv_transfer_lease_expiries_total",
)
# pdserve histogram -> (vLLM names observing the same values, vLLM's buckets).
VLLM_HISTOGRAMS = {
    "time_to_first_token_seconds": (("time_to_first_token_seconds",), VLLM_TTFT_BUCKETS),
    # time_per_output_token_seconds: vLLM's older name of the same gaps, still plotted.
    "inter_token_latency_seconds": (
        ("inter_token_latency_seconds", "time_per_output_token_seconds"),
        VLLM_ITL_BUCKETS,
    ),
    "e2e_request_latency_seconds": (("e2e_request_latency_seconds",), VLLM_REQUEST_BUCKETS),
    "request_queue_time_seconds": (("request_queue_time_seconds",), VLLM_REQUEST_BUCKETS),
    "request_prefill_time_seconds": (("request_prefill_time_seconds",), VLLM_REQUEST_BUCKETS),
    "request_decode_time_seconds": (("request_decode_time_seconds",), VLLM_REQUEST_BUCKETS),
    "kv_transfer_seconds": (("kv_transfer_time_seconds",), TRANSFER_BUCKETS),
}
# vLLM's 1-2-5 token-count buckets (it stops at max_model_len; the gateway starts
# before it knows that, so they go on to a million).
VLLM_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5)) + (1e6,)
# Series only vLLM's dashboard reads: each request's lengths, observed when it ends.
VLLM_LENGTHS = {
    "request_prompt_tokens": "Prompt tokens of each finished request",
    "request_generation_tokens": "Generated tokens of each finished request",
}
_VLLM_STAT_GAUGES = {
    "num_requests_running": lambda s: s.num_running,
    # vLLM's waiting queue also holds the requests whose KV is being pulled.
    "num_requests_waiting": lambda s: s.num_waiting + s.num_waiting_for_remote_kvs,
    "kv_cache_usage_perc": lambda s: s.kv_cache_usage_perc,
}

_STAT_GAUGES = {
    "num_requests_running": lambda s: s.num_running,
    "num_requests_waiting": lambda s: s.num_waiting,
    "num_requests_waiting_for_remote_kvs": lambda s: s.num_waiting_for_remote_kvs,
    "kv_transfers_in_flight": lambda s: s.num_kv_transfers_in_flight,
    "kv_cache_usage_perc": lambda s: s.kv_cache_usage_perc,
    "kv_pull_recompute_ratio": recompute_ratio,
}


class VLLMSeries:
    """The `vllm:*` twins of the pdserve series, labelled `model_name`, `role`, `instance`."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        series = SeriesBuilder(registry, VLLM_PREFIX)
        self.gauges = {n: series.gauge(n, GAUGES[n], VLLM_LABELS) for n in _VLLM_STAT_GAUGES}
        self.counters = {
            n: series.counter(
                n,
                COUNTERS.get(n, "KV transfers whose lease ran out on the prefill side"),
                VLLM_LABELS,
            )
            for n in VLLM_COUNTERS
        }
        self.histograms: dict[str, list[Histogram]] = {
            n: [series.histogram(v, HISTOGRAMS[n][0], VLLM_LABELS, buckets=b) for v in names]
            for n, (names, b) in VLLM_HISTOGRAMS.items()
        }
        self.lengths = {
            n: series.histogram(n, d, VLLM_LABELS, buckets=VLLM_TOKEN_BUCKETS)
            for n, d in VLLM_LENGTHS.items()
        }
        self.success = series.counter(
            "request_success",
            "Requests that finished, by finish reason",
            (*VLLM_LABELS, "finished_reason"),
        )

    def add_instance(self, role: str, instance: str) -> None:
        for metric in (*self.gauges.values(), *self.counters.values(), *self.lengths.values()):
            metric.labels(self.model_name, role, instance)
        for histograms in self.histograms.values():
            for histogram in histograms:
                histogram.labels(self.model_name, role, instance)
        for reason in FINISHED_REASONS:
            self.success.labels(self.model_name, role, instance, reason)

    def remove_gauges(self, role: str, instance: str) -> None:
        for gauge in self.gauges.values():
            with contextlib.suppress(KeyError):
                gauge.remove(self.model_name, role, instance)

    def record_stats(self, role: str, instance: str, stats: InstanceStats) -> None:
        for name, read in _VLLM_STAT_GAUGES.items():
            self.gauges[name].labels(self.model_name, role, instance).set(read(stats))

    def count(self, name: str, role: str, instance: str, value: float) -> None:
        counter = self.counters.get(name)
        if counter is not None:
            counter.labels(self.model_name, role, instance).inc(value)

    def observe(self, name: str, role: str, instance: str, values: list[float]) -> None:
        for histogram in self.histograms.get(name, ()):
            child = histogram.labels(self.model_name, role, instance)
            for value in values:
                child.observe(value)

    def count_success(self, role: str, instance: str, finished_reason: str) -> None:
        self.success.labels(self.model_name, role, instance, finished_reason).inc()

    def observe_lengths(self, role: str, instance: str, prompt: int, generation: int) -> None:
        labels = (self.model_name, role, instance)
        self.lengths["request_prompt_tokens"].labels(*labels).observe(prompt)
        self.lengths["request_generation_tokens"].labels(*labels).observe(generation)


class TenantSeries:
    """Per-tenant counters, labelled by the tenant's name only (never a key)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        series = SeriesBuilder(registry)

        def counter(name: str, documentation: str) -> Counter:
            return series.counter(name, documentation, ("tenant",))

        self.requests = counter("tenant_requests", "Generation requests admitted, per tenant")
        self.prompt_tokens = counter("tenant_prompt_tokens", "Prompt tokens, per tenant")
        self.generation_tokens = counter("tenant_generation_tokens", "Tokens generated, per tenant")
        self.limited = counter("tenant_rate_limited", "Requests refused with 429, per tenant")

    def add(self, tenant: str) -> None:
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens, self.limited):
            metric.labels(tenant)

    def admitted(self, tenant: str) -> None:
        self.requests.labels(tenant).inc()

    def rate_limited(self, tenant: str) -> None:
        self.limited.labels(tenant).inc()

    def used(self, tenant: str, usage: dict[str, int]) -> None:
        self.prompt_tokens.labels(tenant).inc(usage["prompt_tokens"])
        self.generation_tokens.labels(tenant).inc(usage["completion_tokens"])


class GatewayMetrics:
    def __init__(self, model_name: str = "") -> None:
        """`model_name`: the served model name, the `model_name` label of `vllm:*`."""
        disable_created_metrics()  # the *_created series only double the page
        self.registry = CollectorRegistry(auto_describe=True)
        self.series = series = SeriesBuilder(self.registry)
        self.gauges = {n: series.gauge(n, d, LABELS) for n, d in GAUGES.items()}
        self.counters = {n: series.counter(n, d, LABELS) for n, d in COUNTERS.items()}
        self.histograms = {
            n: series.histogram(n, d, LABELS, buckets=b) for n, (d, b) in HISTOGRAMS.items()
        }
        self.vllm = VLLMSeries(self.registry, model_name)
        self.tenants = TenantSeries(self.registry)
        self.deployment = DeploymentSeries(self.registry)  # what alert rules compare against
        self.dropped_frames = DroppedFrameSeries(self.registry)
        self.roles = RoleSeries(self.registry)
        self.rejected = series.counter(
            "num_requests_rejected", "Requests refused by admission control (503)"
        )
        self.retried = series.counter(
            "num_requests_retried",
            "Requests sent again after their instance died before their first token",
        )
        self.rank_kv_bytes = series.counter(
            "kv_transfer_rank_bytes",
            "KV bytes moved by each rank of an instance (a tensor-parallel rank moves its "
            "heads' slice)",
            (*LABELS, "rank"),
        )
        self.migrated = series.counter(
            "requests_migrated",
            "Requests whose instance died mid-stream, sent with the tokens already "
            "streamed to another instance that went on from the next one",
        )
        self.restarted = series.counter(
            "num_instances_restarted",
            "Instances whose process exited, started again by the supervisor and "
            "re-admitted once their weights loaded",
        )
        self.request_phase = series.histogram(
            "request_phase_seconds",
            "Each request's phases as its timeline has them (docs/operations.md)",
            ("phase",),
            buckets=LATENCY_BUCKETS,
        )
        for phase in PHASES:  # every phase shows from the start, at zero
            self.request_phase.labels(phase)
        self.fenced = series.counter(
            "num_instances_fenced",
            "Instances silent past --instance-timeout or stalled past "
            "--instance-stall-timeout: their epoch retired, killed and replaced",
            LABELS,
        )

    def add_instance(self, role: str, instance_id: str) -> None:
        """Every series of the instance shows from the start, at zero."""
        for metric in (*self.gauges.values(), *self.counters.values(), *self.histograms.values()):
            metric.labels(role, instance_id)
        self.fenced.labels(role, instance_id)
        self.vllm.add_instance(role, instance_id)
        self.gauges["instance_up"].labels(role, instance_id).set(1)
        self.roles.show(instance_id, role)

    def move_instance(self, old: str, new: str, instance_id: str) -> None:
        """The instance switched role: its gauges move to the new role's label at once
        (counters and histograms keep what they counted under the old one)."""
        self.mark_down(old, instance_id)
        with contextlib.suppress(KeyError):
            self.gauges["instance_up"].remove(old, instance_id)
        self.add_instance(new, instance_id)
        self.deployment.move_instance(new, instance_id)

    def mark_down(self, role: str, instance_id: str) -> None:
        """A dead instance's load gauges go at once (a stale `num_requests_running` would
        read as load nobody carries); `instance_up` stays, at 0, and counters stay."""
        self.gauges["instance_up"].labels(role, instance_id).set(0)
        for name, gauge in self.gauges.items():
            if name != "instance_up":
                with contextlib.suppress(KeyError):
                    gauge.remove(role, instance_id)
        self.vllm.remove_gauges(role, instance_id)

    def record_output(self, output: InstanceOutput) -> None:
        role, instance = output.instance.role, output.instance.instance_id
        if output.stats is not None:
            self.record_stats(role, instance, output.stats)
        if output.metrics is None:
            return
        for name, value in output.metrics.counters.items():
            counter = self.counters.get(name) or self._reported(
                name, self.series.counter, self.counters
            )
            if counter is not None and value > 0:
                counter.labels(role, instance).inc(value)
                self.vllm.count(name, role, instance, value)
        for name, values in output.metrics.histograms.items():
            histogram = self.histograms.get(name) or self._reported(
                name, self.series.histogram, self.histograms
            )
            if histogram is not None:
                child = histogram.labels(role, instance)
                for value in values:
                    child.observe(value)
                self.vllm.observe(name, role, instance, values)
        for rank, moved in output.metrics.rank_kv_bytes.items():
            self.rank_kv_bytes.labels(role, instance, str(rank)).inc(moved)
        self.dropped_frames.add(output.metrics.dropped_frames)

    def record_stats(self, role: str, instance: str, stats: InstanceStats) -> None:
        for name, read in _STAT_GAUGES.items():
            self.gauges[name].labels(role, instance).set(read(stats))
        self.vllm.record_stats(role, instance, stats)

    def observe(self, name: str, role: str, instance: str, seconds: float) -> None:
        self.histograms[name].labels(role, instance).observe(seconds)
        self.vllm.observe(name, role, instance, [seconds])

    def count(self, name: str, role: str, instance: str, value: float = 1.0) -> None:
        self.counters[name].labels(role, instance).inc(value)
        self.vllm.count(name, role, instance, value)

    def count_success(self, role: str, instance: str, finished_reason: str) -> None:
        """A request finished: pdserve's counter per instance, vLLM's per reason too."""
        self.counters["request_success_total"].labels(role, instance).inc()
        self.vllm.count_success(role, instance, finished_reason)

    def observe_lengths(self, role: str, instance: str, prompt: int, generation: int) -> None:
        """A finished request's prompt and generated token counts (`vllm:*` only)."""
        self.vllm.observe_lengths(role, instance, prompt, generation)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _reported(
        self, name: str, make: Callable[[str, str, Sequence[str]], S], known: dict[str, S]
    ) -> S | None:
        """A series an instance kind sends that the gateway does not list (yet); None for
        a name Prometheus cannot take or one that clashes with a series registered."""
        if not _NAME.match(name):
            return None
        try:
            known[name] = make(name, f"{name} (reported by instances)", LABELS)
        except ValueError:
            return None
        return known[name]
