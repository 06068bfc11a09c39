"""Per-request outcomes and the summary statistics `vllm bench serve` reports.

Field names and definitions follow vLLM's serving benchmark so results can be compared
side by side: TTFT from send to the first streamed token, ITL as the gaps between
streamed chunks, TPOT = (E2E - TTFT) / (output tokens - 1), and goodput as completed
requests per second that meet every given SLO (DistServe's definition).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 95.0, 99.0)


@dataclass
class RequestOutcome:
    """What one request did, as seen by the client. Times are in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""

    def tpot(self) -> float:
        """Mean time per output token after the first; 0 for single-token outputs."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep:
            raise ValueError(f"goodput SLO '{pair}' must look like NAME:MILLISECONDS")
        if name not in GOODPUT_METRICS:
            raise ValueError(
                f"goodput SLO name '{name}' must be one of {', '.join(GOODPUT_METRICS)}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO '{pair}': '{value}' is not a number") from None
        if slos[name] < 0:
            raise ValueError(f"goodput SLO '{pair}' must be non-negative")
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`"50,95,99"` -> [50.0, 95.0, 99.0], each in (0, 100]."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"percentiles '{text}' must be comma-separated numbers") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise ValueError(f"percentiles '{text}' must lie in (0, 100]")
    return values


def parse_metric_names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown or not names:
        raise ValueError(f"percentile metrics must be among {', '.join(METRIC_NAMES)}: '{text}'")
    return names


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def meets_slos(outcome: RequestOutcome, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": outcome.ttft, "tpot": outcome.tpot(), "e2el": outcome.latency}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def summarize(
    outcomes: list[RequestOutcome],
    duration_s: float,
    percentiles: list[float] | tuple[float, ...] = DEFAULT_PERCENTILES,
    percentile_metrics: list[str] | tuple[str, ...] = METRIC_NAMES,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict:
    """The vLLM-shaped result dict for a finished run (without run configuration)."""
    done = [o for o in outcomes if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    duration_s = max(duration_s, 1e-9)
    samples = {
        "ttft": [o.ttft for o in done],
        # Single-token outputs have no TPOT; vLLM leaves them out of the statistics.
        "tpot": [o.tpot() for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    good = sum(meets_slos(o, goodput_slos_ms) for o in done) if goodput_slos_ms else None
    result: dict = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "input_throughput": total_input / duration_s,
        "max_concurrent_requests": peak_concurrency(done),
    }
    for name in percentile_metrics:
        values_ms = np.asarray(samples[name], dtype=float) * 1000.0
        if values_ms.size == 0:
            values_ms = np.zeros(1)
        result[f"mean_{name}_ms"] = float(values_ms.mean())
        result[f"median_{name}_ms"] = float(np.median(values_ms))
        result[f"std_{name}_ms"] = float(values_ms.std())
        for p in percentiles:
            result[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(values_ms, p))
    result["input_lens"] = [o.prompt_len for o in outcomes]
    result["output_lens"] = [o.output_tokens if o.success else 0 for o in outcomes]
    result["ttfts"] = [o.ttft if o.success else 0.0 for o in outcomes]
    result["itls"] = [o.itl if o.success else [] for o in outcomes]
    result["errors"] = [o.error for o in outcomes]
    return result


def peak_concurrency(outcomes: list[RequestOutcome]) -> int:
    """The most requests that were in flight at the same instant."""
    edges = sorted(
        [(o.start_time, 1) for o in outcomes] + [(o.start_time + o.latency, -1) for o in outcomes],
        key=lambda edge: (edge[0], edge[1]),
    )
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak
