"""One benchmark run: send a dataset's requests on an arrival schedule, summarize.

Requests are released at their arrival offsets (Poisson/gamma, infinite rate, or
replayed timestamps) and then wait for a slot under `max_concurrency`; TTFT is taken
from the moment a request is actually sent. Warm-up requests run first and are left
out of the results.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import DEFAULT_ENDPOINTS, CompletionsClient
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import DEFAULT_PERCENTILES, METRIC_NAMES, RequestOutcome, summarize
from pdserve.bench.progress import ProgressBar


@dataclass
class RunConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    percentiles: list[float] = field(default_factory=lambda: list(DEFAULT_PERCENTILES))
    percentile_metrics: list[str] = field(default_factory=lambda: list(METRIC_NAMES))
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    replay_timestamps: bool = False
    show_progress: bool = True
    extra_body: dict | None = None
    backend: str = "openai"
    endpoint: str | None = None  # None: the backend's default
    temperature: float = 0.0
    label: str | None = None
    tokenizer_id: str | None = None
    save_detailed: bool = False
    metadata: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be non-negative, got {self.num_warmups}")
        if not self.timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive, got {self.timeout_s}")


async def resolve_model(client: CompletionsClient, model: str | None) -> str | None:
    """The given model, else the server's only one. None if the server cannot say."""
    if model:
        return model
    try:
        models = await client.list_models()
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        # Unreachable or odd server: the requests themselves will report why.
        return None
    if len(models) > 1:
        raise ValueError(f"the server serves several models ({', '.join(models)}): pass --model")
    return models[0] if models else None


def send_schedule(samples: list[SampleRequest], config: RunConfig) -> list[float]:
    if config.replay_timestamps:
        if any(s.timestamp is None for s in samples):
            raise ValueError("--replay-timestamps needs a 'timestamp' on every request")
        first = min(float(s.timestamp or 0.0) for s in samples)
        return [float(s.timestamp or 0.0) - first for s in samples]
    offsets = arrival_offsets(len(samples), config.request_rate, config.burstiness, config.seed)
    return [float(t) for t in offsets]


class Run:
    """Drives one run against one server."""

    def __init__(self, config: RunConfig, client: CompletionsClient) -> None:
        self.config = config
        self.client = client
        limit = config.max_concurrency
        self.slots = asyncio.Semaphore(limit) if limit else None
        self.model: str | None = None

    async def send(self, sample: SampleRequest, progress: ProgressBar | None) -> RequestOutcome:
        if self.slots is None:
            outcome = await self.client.complete(sample, self.model, self.config.ignore_eos)
        else:
            async with self.slots:
                outcome = await self.client.complete(sample, self.model, self.config.ignore_eos)
        if progress is not None:
            progress.advance(outcome.success)
        return outcome

    async def warm_up(self, samples: list[SampleRequest]) -> None:
        count = self.config.num_warmups
        if count == 0:
            return
        progress = ProgressBar(count, "warm-up requests", self.config.show_progress)
        chosen = [samples[i % len(samples)] for i in range(count)]
        await asyncio.gather(*(self.send(s, progress) for s in chosen))
        progress.close()

    async def measure(self, samples: list[SampleRequest]) -> tuple[list[RequestOutcome], float]:
        schedule = send_schedule(samples, self.config)
        progress = ProgressBar(len(samples), "requests", self.config.show_progress)
        start = time.perf_counter()
        tasks = []
        for sample, offset in zip(samples, schedule, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.send(sample, progress)))
        outcomes = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        progress.close()
        return outcomes, duration


async def run_benchmark(
    samples: list[SampleRequest], config: RunConfig, client: CompletionsClient | None = None
) -> dict:
    """Run `samples` against the server and return vLLM-shaped results.

    A caller running several benchmarks in a row (a sweep) may pass its own client so
    that warm connections carry over from one run to the next.
    """
    config.validate()
    if not samples:
        raise ValueError("no requests to send")
    own_client = client is None
    if client is None:
        connections = config.max_concurrency or min(len(samples), 1000)
        client = CompletionsClient(
            config.base_url,
            config.timeout_s,
            max(connections, 1),
            config.extra_body,
            backend=config.backend,
            endpoint=config.endpoint,
            temperature=config.temperature,
        )
    try:
        run = Run(config, client)
        run.model = await resolve_model(client, config.model)
        await run.warm_up(samples)
        outcomes, duration = await run.measure(samples)
    finally:
        if own_client:
            await client.close()
    summary = summarize(
        outcomes,
        duration,
        config.percentiles,
        config.percentile_metrics,
        config.goodput_slos_ms or None,
    )
    if config.save_detailed:
        summary["generated_texts"] = [o.generated_text for o in outcomes]
    # vLLM puts --metadata pairs at the top level of the result.
    return {**result_header(config, run.model, len(samples)), **summary, **config.metadata}


def result_header(config: RunConfig, model: str | None, num_prompts: int) -> dict:
    """The run's configuration, under vLLM's field names."""
    rate = config.request_rate
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": config.backend,
        "endpoint_type": config.backend,
        "label": config.label,
        "endpoint": config.endpoint or DEFAULT_ENDPOINTS[config.backend],
        "base_url": config.base_url,
        "model_id": model,
        "tokenizer_id": config.tokenizer_id,
        "num_prompts": num_prompts,
        "num_warmups": config.num_warmups,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "goodput_slos_ms": config.goodput_slos_ms or None,
    }


def default_result_filename(result: dict) -> str:
    """vLLM's name: `{label or backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json`."""
    model = str(result.get("model_id") or "model").rstrip("/").split("/")[-1]
    concurrency = result.get("max_concurrency")
    limit = f"-concurrency{concurrency}" if concurrency else ""
    prefix = result.get("label") or result.get("backend") or "openai"
    return f"{prefix}-{result['request_rate']}qps{limit}-{model}-{result['date']}.json"


def save_result(result: dict, filename: str | None, result_dir: str | None = None) -> Path:
    """Write the result JSON; `result_dir` (created if missing) holds it, as in vLLM."""
    path = Path(filename or default_result_filename(result))
    if result_dir:
        Path(result_dir).mkdir(parents=True, exist_ok=True)
        path = Path(result_dir) / path
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path


def format_report(result: dict) -> str:
    """The terminal summary, laid out like vLLM's."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(label: str, value: object) -> None:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44} {shown:>15}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate") != "inf":
        row("Request rate configured (RPS):", float(result["request_rate"]))
    row("Benchmark duration (s):", float(result["duration"]))
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", float(result["request_throughput"]))
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", float(result["request_goodput"]))
    row("Output token throughput (tok/s):", float(result["output_throughput"]))
    row("Total token throughput (tok/s):", float(result["total_token_throughput"]))
    titles = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for name, (title, short_name) in titles.items():
        keys = [k for k in result if k.endswith(f"_{name}_ms")]
        if not keys:
            continue
        lines.append(f"{' ' + title + ' ':-^60}")
        for key in keys:
            stat = key.split("_", 1)[0]
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(stat, stat.upper())
            row(f"{label} {short_name} (ms):", float(result[key]))
    errors = sorted({e for e in result.get("errors", []) if e})
    if errors:
        lines.append(f"{' Errors ':-^60}")
        lines.extend(f"  {e}" for e in errors[:5])
        if len(errors) > 5:
            lines.append(f"  ... and {len(errors) - 5} other distinct errors")
    lines.append("=" * 60)
    return "\n".join(lines)
