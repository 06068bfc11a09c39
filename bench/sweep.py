"""`pdserve bench sweep`: the load-test procedure that finds a server's working point.

Warm up (results discarded), then run steps of rising concurrency, each with its own
fresh requests so no step profits from the previous one's prefix cache. At every step
record the latency percentiles, throughput, and the server's peak KV-cache usage and
new preemptions from `/metrics`. Stop at the first step where p95 TTFT or p95 ITL
exceeds its SLO, throughput gains less than the plateau threshold, preemptions
appear, or requests fail. The working point is the last good step minus 20-25%.

The last good step also gives per-GPU phase throughputs for `pdserve plan`: directly
for disaggregated pools, or, for a colocated server, from a prefill probe (the same
concurrency with one output token) that tells how much of the GPU time prefill took.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.bench.client import CompletionsClient
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import DEFAULT_PERCENTILES
from pdserve.bench.runner import RunConfig, run_benchmark
from pdserve.bench.server_metrics import MetricsWatcher
from pdserve.common.named_values import named_values

DEFAULT_STEPS = (1, 4, 8, 16, 32, 64, 128)
PER_REQUEST_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "errors")

# The RunConfig fields each step takes from the SweepConfig field of the same name.
STEP_SETTINGS = (
    "base_url",
    "model",
    "ignore_eos",
    "timeout_s",
    "show_progress",
    "seed",
    "backend",
    "endpoint",
    "temperature",
    "extra_body",
)


@dataclass
class SweepConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    concurrency_steps: list[int] = field(default_factory=lambda: list(DEFAULT_STEPS))
    requests_per_step: int = 300
    num_warmups: int = 100
    warmup_concurrency: int = 8
    ttft_slo_ms: float = 2000.0
    itl_slo_ms: float = 50.0
    plateau_gain: float = 0.10
    backoff: tuple[float, float] = (0.20, 0.25)
    percentiles: list[float] = field(default_factory=lambda: list(DEFAULT_PERCENTILES))
    ignore_eos: bool = False
    timeout_s: float = 600.0
    num_gpus: int = 1
    num_prefill_gpus: int | None = None
    num_decode_gpus: int | None = None
    prefill_probe: bool = True
    metrics_interval_s: float = 0.5
    show_progress: bool = True
    seed: int = 0
    backend: str = "openai"
    endpoint: str | None = None
    temperature: float = 0.0
    extra_body: dict | None = None

    def validate(self) -> None:
        steps = self.concurrency_steps
        if not steps or any(c < 1 for c in steps) or sorted(set(steps)) != list(steps):
            raise ValueError("concurrency steps must be distinct, increasing and at least 1")
        if self.requests_per_step < 1:
            raise ValueError("--requests-per-step must be at least 1")
        if not self.metrics_interval_s > 0:
            raise ValueError("--metrics-interval-s must be positive")
        if self.num_warmups < 0 or self.warmup_concurrency < 1:
            raise ValueError("warm-up count must be >= 0 and its concurrency >= 1")
        if (self.num_prefill_gpus is None) != (self.num_decode_gpus is None):
            raise ValueError("give both --num-prefill-gpus and --num-decode-gpus, or neither")
        if 95.0 not in self.percentiles:
            self.percentiles = sorted({*self.percentiles, 95.0})

    def requests_needed(self) -> int:
        probe = self.requests_per_step if self.prefill_probe else 0
        return self.num_warmups + len(self.concurrency_steps) * self.requests_per_step + probe

    def run_config(self, concurrency: int) -> RunConfig:
        """One step's run: the sweep's own settings (`STEP_SETTINGS`), no warm-ups (they
        run once, before the first step)."""
        return RunConfig(
            max_concurrency=concurrency,
            percentiles=list(self.percentiles),
            **named_values(self, STEP_SETTINGS),
        )


def stop_reasons(step: dict, previous: dict | None, config: SweepConfig) -> list[str]:
    """Why this step ends the sweep (empty: keep going)."""
    reasons = []
    if step["failed"]:
        reasons.append(f"{step['failed']} requests failed")
    if step["p95_ttft_ms"] > config.ttft_slo_ms:
        reasons.append(f"p95 TTFT {step['p95_ttft_ms']:.1f} ms > SLO {config.ttft_slo_ms:g} ms")
    if step["p95_itl_ms"] > config.itl_slo_ms:
        reasons.append(f"p95 ITL {step['p95_itl_ms']:.1f} ms > SLO {config.itl_slo_ms:g} ms")
    if previous is not None and previous["output_throughput"] > 0:
        gain = step["output_throughput"] / previous["output_throughput"] - 1.0
        if gain < config.plateau_gain:
            reasons.append(
                f"throughput plateau: {gain:+.1%} over concurrency {previous['concurrency']} "
                f"(< {config.plateau_gain:.0%})"
            )
    if step.get("num_preemptions"):
        reasons.append(f"{step['num_preemptions']:g} preemptions")
    return reasons


def working_point(steps: list[dict], stop_index: int | None, backoff: tuple[float, float]):
    """The last good step's concurrency less 20-25%; None if even the first step failed."""
    base_index = len(steps) - 1 if stop_index is None else stop_index - 1
    if base_index < 0:
        return None
    base = steps[base_index]["concurrency"]
    low = max(1, math.ceil(base * (1 - max(backoff))))
    high = max(low, math.floor(base * (1 - min(backoff))))
    return {
        "base_concurrency": base,
        "concurrency_low": low,
        "concurrency_high": high,
        "note": "last good step" if stop_index is not None else "no stop condition reached",
    }


def step_record(concurrency: int, result: dict, server: dict) -> dict:
    record: dict[str, Any] = {"concurrency": concurrency}
    record.update({k: v for k, v in result.items() if k not in PER_REQUEST_FIELDS})
    record["mean_input_tokens"] = result["total_input_tokens"] / max(1, result["completed"])
    record["mean_output_tokens"] = result["total_output_tokens"] / max(1, result["completed"])
    record["errors"] = sorted({e for e in result["errors"] if e})[:5]
    record.update(server)
    return record


async def measure_step(
    samples: list[SampleRequest], concurrency: int, config: SweepConfig, client: CompletionsClient
) -> tuple[dict, dict]:
    watcher = MetricsWatcher(config.base_url, config.metrics_interval_s)
    await watcher.start()
    try:
        result = await run_benchmark(samples, config.run_config(concurrency), client)
    finally:
        server = await watcher.stop()
    return result, server


def phase_throughputs(base: dict, probe: dict | None, config: SweepConfig) -> dict:
    """Per-GPU prefill and decode tokens/s at the last good step, and how they were got."""
    capacity = {
        "concurrency": base["concurrency"],
        "input_tokens_per_s": base["input_throughput"],
        "output_tokens_per_s": base["output_throughput"],
        "request_throughput": base["request_throughput"],
        "mean_input_tokens": base["mean_input_tokens"],
        "mean_output_tokens": base["mean_output_tokens"],
        "num_gpus": config.num_gpus,
        "num_prefill_gpus": config.num_prefill_gpus,
        "num_decode_gpus": config.num_decode_gpus,
        "prefill_tokens_per_s_per_gpu": None,
        "decode_tokens_per_s_per_gpu": None,
        "method": "none: colocated server without a prefill probe",
    }
    if config.num_prefill_gpus and config.num_decode_gpus:
        capacity["prefill_tokens_per_s_per_gpu"] = (
            base["input_throughput"] / config.num_prefill_gpus
        )
        capacity["decode_tokens_per_s_per_gpu"] = base["output_throughput"] / config.num_decode_gpus
        capacity["method"] = "disaggregated pools at the last good step (lower bounds)"
    elif probe is not None and probe["input_throughput"] > 0:
        prefill_total = probe["input_throughput"]
        prefill_share = base["input_throughput"] / prefill_total
        capacity["prefill_tokens_per_s_per_gpu"] = prefill_total / config.num_gpus
        capacity["prefill_time_share"] = prefill_share
        if prefill_share < 0.95:
            capacity["decode_tokens_per_s_per_gpu"] = base["output_throughput"] / (
                config.num_gpus * (1 - prefill_share)
            )
        capacity["method"] = "prefill probe at the last good step's concurrency"
    return capacity


async def sweep_steps(config: SweepConfig, take, client: CompletionsClient):
    warmup = None
    if config.num_warmups:
        warmup_result = await run_benchmark(
            take(config.num_warmups), config.run_config(config.warmup_concurrency), client
        )
        warmup = {k: warmup_result[k] for k in ("completed", "failed", "duration")}
    steps: list[dict] = []
    stop_index = None
    for concurrency in config.concurrency_steps:
        result, server = await measure_step(
            take(config.requests_per_step), concurrency, config, client
        )
        step = step_record(concurrency, result, server)
        step["stop_reasons"] = stop_reasons(step, steps[-1] if steps else None, config)
        steps.append(step)
        if step["stop_reasons"]:
            stop_index = len(steps) - 1
            break
    point = working_point(steps, stop_index, config.backoff)
    capacity = None
    if point is not None:
        base = next(s for s in steps if s["concurrency"] == point["base_concurrency"])
        probe = None
        if config.prefill_probe and config.num_prefill_gpus is None:
            probe_samples = [
                SampleRequest(s.prompt, s.prompt_len, 1) for s in take(config.requests_per_step)
            ]
            probe, _ = await measure_step(probe_samples, base["concurrency"], config, client)
        capacity = phase_throughputs(base, probe, config)
    return warmup, steps, stop_index, capacity


async def run_sweep(samples: list[SampleRequest], config: SweepConfig) -> dict:
    """The sweep over `samples` (at least `config.requests_needed()` of them)."""
    config.validate()
    if len(samples) < config.requests_needed():
        raise ValueError(f"the sweep needs {config.requests_needed()} requests")
    cursor = 0

    def take(count: int) -> list[SampleRequest]:
        nonlocal cursor
        chunk = samples[cursor : cursor + count]
        cursor += count
        return chunk

    # One client for the whole sweep: connections opened by the warm-up stay warm.
    client = CompletionsClient(
        config.base_url,
        config.timeout_s,
        max(config.concurrency_steps + [config.warmup_concurrency]),
        config.extra_body,
        backend=config.backend,
        endpoint=config.endpoint,
        temperature=config.temperature,
    )
    try:
        warmup, steps, stop_index, capacity = await sweep_steps(config, take, client)
    finally:
        await client.close()
    point = working_point(steps, stop_index, config.backoff)
    config_record = asdict(config)
    return {
        "config": config_record,
        "model_id": steps[0].get("model_id") if steps else None,
        "warmup": warmup,
        "steps": steps,
        "stopped_at": None
        if stop_index is None
        else {
            "concurrency": steps[stop_index]["concurrency"],
            "reasons": steps[stop_index]["stop_reasons"],
        },
        "working_point": point,
        "capacity": capacity,
    }


def format_sweep(result: dict) -> str:
    header = (
        f"{'conc':>5} {'done':>5} {'fail':>4} {'req/s':>8} {'out tok/s':>10} "
        f"{'p50 TTFT':>9} {'p95 TTFT':>9} {'p50 ITL':>8} {'p95 ITL':>8} "
        f"{'KV use':>7} {'preempt':>7}"
    )
    lines = [header, "-" * len(header)]
    for s in result["steps"]:
        kv = "-" if s.get("kv_cache_usage_perc") is None else f"{s['kv_cache_usage_perc']:.2f}"
        pre = "-" if s.get("num_preemptions") is None else f"{s['num_preemptions']:g}"
        lines.append(
            f"{s['concurrency']:>5} {s['completed']:>5} {s['failed']:>4} "
            f"{s['request_throughput']:>8.2f} {s['output_throughput']:>10.1f} "
            f"{s['p50_ttft_ms']:>9.1f} {s['p95_ttft_ms']:>9.1f} "
            f"{s['p50_itl_ms']:>8.1f} {s['p95_itl_ms']:>8.1f} {kv:>7} {pre:>7}"
        )
    stop = result["stopped_at"]
    if stop:
        lines.append(f"stopped at concurrency {stop['concurrency']}: {'; '.join(stop['reasons'])}")
    else:
        lines.append("no stop condition reached")
    point = result["working_point"]
    if point:
        lines.append(
            f"working point: concurrency {point['concurrency_low']}-{point['concurrency_high']} "
            f"(concurrency {point['base_concurrency']} less 20-25%)"
        )
    else:
        lines.append("no working point: the first step already breaks a limit")
    capacity = result.get("capacity")
    if capacity and capacity.get("prefill_tokens_per_s_per_gpu"):
        decode = capacity.get("decode_tokens_per_s_per_gpu")
        decode_text = f"{decode:.1f}" if decode else "unknown"
        lines.append(
            f"per GPU: prefill {capacity['prefill_tokens_per_s_per_gpu']:.1f} tok/s, "
            f"decode {decode_text} tok/s ({capacity['method']})"
        )
    return "\n".join(lines)
