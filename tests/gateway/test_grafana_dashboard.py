"""deploy/grafana/pdserve.json asks only for series the gateway's `/metrics` exports,
grouped only by labels they carry."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pdserve.gateway.controller_metrics import ControllerSeries
from pdserve.gateway.metrics import GatewayMetrics
from tests.gateway.exported_series import exported_series, series_in

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Series name -> label names, as `/metrics` shows them once instances are known
    (with `--autoscale slo`: the SLO controller's series too)."""
    metrics = GatewayMetrics(model_name="m")
    ControllerSeries(metrics.registry).count("hold", "policy_error")
    for role in ("prefill", "decode", "colocated"):
        metrics.add_instance(role, f"{role}-0")
    return exported_series(metrics)


def queries(node: Any) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and template queries."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        return found + [q for v in node.values() for q in queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in queries(v)]
    return []


def test_every_dashboard_query_names_exported_series_and_labels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    series = exported()
    exprs = queries(dashboard)
    assert len(exprs) > 20
    for expr in exprs:
        names = series_in(expr)
        assert names, f"no pdserve or vLLM series in {expr!r}"
        missing = names - series.keys()
        assert not missing, f"{expr!r} names series /metrics lacks: {missing}"
        carried = set.intersection(*(series[n] for n in names)) | {"le"}
        for group in _GROUPING.findall(expr):
            labels = {label.strip() for label in group.split(",") if label.strip()}
            assert labels <= carried, f"{expr!r} groups by labels its series lack"
        # vLLM's series are always selected by model, as vLLM's dashboard does.
        for name in names:
            if name.startswith("vllm:") and "label_values" not in expr:
                assert re.search(rf"{re.escape(name)}\w*\{{[^}}]*model_name=", expr), expr


def test_the_dashboard_has_vllms_panels_and_the_handoff() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = set().union(*(series_in(e) for e in queries(dashboard)))
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", "vllm:prefix_cache_hits_total",
        "vllm:request_success_total", "vllm:kv_transfer_bytes_total",
        "vllm:kv_transfer_time_seconds", "pdserve:instance_up",
    ):  # fmt: skip
        assert name in used, name
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model_name"}
