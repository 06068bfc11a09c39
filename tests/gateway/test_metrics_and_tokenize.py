"""/metrics (pdserve: and vllm: names, labelled per instance), /tokenize, /detokenize, /health."""

from __future__ import annotations

import re

import pytest

from pdserve.bench.server_metrics import parse_samples

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("idle_after_module")]

MODEL = "SmolLM2-135M-Instruct"
DESIGN_NAMES = [
    "num_requests_running", "num_requests_waiting", "num_requests_waiting_for_remote_kvs",
    "kv_cache_usage_perc", "num_preemptions_total", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "prompt_tokens_total", "generation_tokens_total",
    "kv_transfer_bytes_total", "kv_transfer_seconds", "kv_transfer_failures_total",
]  # fmt: skip


def sample(text: str, name: str, instance: str = "colocated-0") -> float:
    pattern = rf'^pdserve:{name}{{[^}}]*instance="{instance}"[^}}]*}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"no pdserve:{name} sample for {instance}"
    return float(match.group(1))


def test_metrics_export_design_names_and_count_a_request(server) -> None:
    before = server.get("/metrics")
    assert before.status_code == 200
    assert before.headers["content-type"].startswith("text/plain")
    for name in DESIGN_NAMES:
        assert f"# TYPE pdserve:{name.removesuffix('_total')}" in before.text, name
    assert 'role="colocated"' in before.text
    generated = sample(before.text, "generation_tokens_total")
    ttft_count = sample(before.text, "time_to_first_token_seconds_count")
    result = server.openai().completions.create(
        model=MODEL, prompt="Count: one, two,", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert result.usage.completion_tokens == 5
    after = server.get("/metrics").text
    assert sample(after, "generation_tokens_total") == generated + 5
    assert sample(after, "time_to_first_token_seconds_count") == ttft_count + 1
    assert sample(after, "inter_token_latency_seconds_count") >= 4
    assert sample(after, "prompt_tokens_total") >= result.usage.prompt_tokens
    assert sample(after, "num_requests_running") == 0
    assert sample(after, "instance_up") == 1
    # bench's scraper reads the same page.
    assert parse_samples(after)["pdserve:kv_cache_usage_perc"] == [0.0]
    check_vllm_series(after)


VLLM_COUNTED = [
    "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
    "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
    "request_success_total", "prompt_tokens_total", "generation_tokens_total",
    "prefix_cache_queries_total", "request_queue_time_seconds_count",
    "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
    "request_prompt_tokens_count", "request_generation_tokens_count",
]  # fmt: skip
VLLM_SHOWN = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "prefix_cache_hits_total", "num_preemptions_total"]  # fmt: skip


def check_vllm_series(text: str) -> None:
    """vLLM's names beside pdserve's, each with model_name; counts that traffic moved."""
    for name in VLLM_COUNTED + VLLM_SHOWN:
        lines = re.findall(rf"^vllm:{name}{{([^}}]*)}} (\S+)$", text, re.MULTILINE)
        assert lines, f"no vllm:{name}"
        assert all('model_name="' in labels for labels, _ in lines), name
        if name in VLLM_COUNTED:
            assert sum(float(v) for _, v in lines) > 0, name


def test_tokenize_detokenize_round_trip(server) -> None:
    text = "Héllo wörld — naïve café 🙂"
    tokens = server.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 512
    back = server.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    strs = server.post("/tokenize", json={"prompt": "a b", "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"]
    chat = server.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()  # fmt: skip
    assert chat["count"] > 3  # the template's specials and role markers
    bad = server.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400


def test_health_and_models(server) -> None:
    health = server.get("/health").json()
    assert health["status"] == "ok"
    (instance,) = health["instances"]
    assert (instance["role"], instance["alive"]) == ("colocated", True)
    assert instance["kernels"]  # which attention/fused-op path runs, never blank
    models = server.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512
