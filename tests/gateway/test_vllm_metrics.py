"""`/metrics` under vLLM's names (`vllm:*{model_name=...}`) beside pdserve's, from
recorded instance outputs: no server, no model."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.messages import (
    InstanceAddress,
    InstanceOutput,
    InstanceStats,
    MetricsDelta,
)
from pdserve.gateway.metrics import GatewayMetrics

MODEL = "served-model"
# The vLLM series pdserve exports, with the kind of count it must show after traffic.
VLLM_COUNTED = [
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
    "vllm:kv_transfer_bytes_total", "vllm:kv_transfer_time_seconds_count",
    "vllm:kv_transfer_failures_total", "vllm:kv_transfer_lease_expiries_total",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
]  # fmt: skip
VLLM_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]


def output(role: str, instance: str, **metrics: dict) -> InstanceOutput:
    return InstanceOutput(
        instance=InstanceAddress(instance, role, "tcp://127.0.0.1:1"),
        stats=InstanceStats(num_running=2, num_waiting=1, num_waiting_for_remote_kvs=3,
                            kv_cache_usage_perc=0.25),
        metrics=MetricsDelta(**metrics),
    )  # fmt: skip


def traffic() -> GatewayMetrics:
    """One disaggregated request as the gateway sees it: P's output, D's, its timings."""
    metrics = GatewayMetrics(model_name=MODEL)
    metrics.add_instance("prefill", "prefill-0")
    metrics.add_instance("decode", "decode-0")
    metrics.record_output(output(
        "prefill", "prefill-0",
        counters={"prompt_tokens_total": 12, "generation_tokens_total": 1,
                  "prefix_cache_queries_total": 12, "prefix_cache_hits_total": 4,
                  "num_preemptions_total": 1, "kv_transfer_bytes_total": 4096,
                  "kv_transfer_lease_expiries_total": 1},
        histograms={"request_queue_time_seconds": [0.01],
                    "request_prefill_time_seconds": [0.2]},
    ))  # fmt: skip
    metrics.record_output(output(
        "decode", "decode-0",
        counters={"generation_tokens_total": 4, "kv_transfer_bytes_total": 4096,
                  "kv_transfer_failures_total": 1},
        histograms={"kv_transfer_seconds": [0.003], "request_decode_time_seconds": [0.5]},
    ))  # fmt: skip
    metrics.observe("time_to_first_token_seconds", "prefill", "prefill-0", 0.3)
    for _ in range(4):
        metrics.observe("inter_token_latency_seconds", "decode", "decode-0", 0.02)
    metrics.observe("e2e_request_latency_seconds", "decode", "decode-0", 0.4)
    metrics.count_success("decode", "decode-0", "length")
    metrics.observe_lengths("decode", "decode-0", 12, 5)
    return metrics


def samples(metrics: GatewayMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def test_vllm_series_carry_model_name_and_count_traffic() -> None:
    found = samples(traffic())
    for name in VLLM_COUNTED + VLLM_GAUGES:
        assert name in found, name
        assert all(labels["model_name"] == MODEL for labels, _ in found[name]), name
        assert all({"role", "instance"} <= labels.keys() for labels, _ in found[name]), name
    for name in VLLM_COUNTED:
        assert sum(v for _, v in found[name]) > 0, name


def test_vllm_series_match_pdserve_values() -> None:
    found = samples(traffic())

    def value(name: str, **want: str) -> float:
        return sum(v for labels, v in found[name] if want.items() <= labels.items())

    assert value("vllm:generation_tokens_total") == value("pdserve:generation_tokens_total") == 5
    assert value("vllm:kv_transfer_bytes_total", role="decode") == 4096
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_success_total", finished_reason="stop") == 0  # shown at zero
    assert value("pdserve:request_success_total") == 1
    assert value("vllm:request_generation_tokens_sum") == 5
    assert value("vllm:request_prompt_tokens_bucket", le="10.0") == 0
    assert value("vllm:request_prompt_tokens_bucket", le="20.0") == 1
    # vLLM's waiting queue holds the requests pulling KV: 1 waiting + 3 pulling.
    assert value("vllm:num_requests_waiting", instance="decode-0") == 4
    assert value("pdserve:num_requests_waiting", instance="decode-0") == 1
    # vLLM's buckets: TTFT reaches 2560 s, ITL starts at 10 ms.
    ttft_bounds = {labels["le"] for labels, _ in found["vllm:time_to_first_token_seconds_bucket"]}
    assert "2560.0" in ttft_bounds
    itl = {
        labels["le"]: v
        for labels, v in found["vllm:inter_token_latency_seconds_bucket"]
        if labels["instance"] == "decode-0"
    }
    assert itl["0.01"] == 0 and itl["0.025"] == 4
