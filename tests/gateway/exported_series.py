"""What `/metrics` exports, for the checks that dashboards and alert rules read only
exported series: the series a PromQL expression names, and a gateway's series with
their label names."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.messages import InstanceAddress, InstanceOutput, MetricsDelta
from pdserve.gateway.metrics import GatewayMetrics

# Series names: PromQL's functions, keywords and label names never hold a colon.
_SERIES = re.compile(r"\b(?:vllm|pdserve):[a-zA-Z0-9_:]*")
_SUFFIXES = ("_bucket", "_sum", "_count")


def family(name: str) -> str:
    """A histogram's `_bucket`, `_sum` and `_count` belong to its family."""
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def series_in(expr: str) -> set[str]:
    """The families an expression reads."""
    return {family(name) for name in _SERIES.findall(expr)}


def exported_series(metrics: GatewayMetrics) -> dict[str, set[str]]:
    """Family -> label names of what `metrics` renders, once an instance has reported a
    counter the gateway only learns from instances (kv_transfer_lease_expiries_total)."""
    address = InstanceAddress("prefill-0", "prefill", "tcp://127.0.0.1:1")
    counters = {"kv_transfer_lease_expiries_total": 1.0}
    metrics.record_output(InstanceOutput(address, metrics=MetricsDelta(counters=counters)))
    series: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for sample in fam.samples:
            series.setdefault(family(sample.name), set()).update(sample.labels.keys() - {"le"})
    return series
