"""What a token costs on your GPUs, and where an external API becomes cheaper.

- Price per 1M tokens = (hourly GPU price / 3600) x 1,000,000 / tokens per second per
  GPU at the working point. For a deployment: its GPUs' cost per second over the
  tokens per second it serves at peak.
- Split into input and output by the phases' shares of GPU time (the prefill pool's
  GPUs serve the input tokens, the decode pool's the output tokens).
- Daily utilization: the GPUs are paid for all operating hours, but traffic averages
  a fraction f of the peak, so a token costs 1/f times the peak figure.
- Break-even against an API priced per 1M input/output tokens: the average fraction of
  peak traffic above which owning the GPUs is cheaper (above 1: the API is cheaper
  even at full load).
"""

from __future__ import annotations

from dataclasses import dataclass

PER_MILLION = 1_000_000.0
UTILIZATION_TABLE = (1.0, 0.7, 0.5, 0.3, 0.1)


def price_per_million_tokens(gpu_hourly_price: float, tokens_per_s_per_gpu: float) -> float:
    if tokens_per_s_per_gpu <= 0:
        raise ValueError("tokens per second must be positive")
    return gpu_hourly_price / 3600.0 * PER_MILLION / tokens_per_s_per_gpu


@dataclass(frozen=True)
class CostInputs:
    gpu_hourly_price: float
    hours_per_day: float = 24.0
    days_per_year: float = 365.0
    api_input_price: float | None = None  # per 1M tokens
    api_output_price: float | None = None

    def validate(self) -> None:
        if self.gpu_hourly_price < 0:
            raise ValueError("--gpu-hourly-price must be non-negative")
        if not 0 < self.hours_per_day <= 24 or not 0 < self.days_per_year <= 366:
            raise ValueError("--hours-per-day must be in (0, 24] and --days-per-year in (0, 366]")
        if (self.api_input_price is None) != (self.api_output_price is None):
            raise ValueError("give both --api-input-price and --api-output-price, or neither")


def plan_cost(
    costs: CostInputs,
    gpus: int,
    prefill_gpu_share: float,
    input_tokens_per_s: float,
    output_tokens_per_s: float,
) -> dict:
    """Cost figures for `gpus` GPUs serving the given peak token rates."""
    costs.validate()
    if gpus < 1 or input_tokens_per_s <= 0 or output_tokens_per_s <= 0:
        raise ValueError("GPU count and token rates must be positive")
    cost_per_s = gpus * costs.gpu_hourly_price / 3600.0
    total_tokens_per_s = input_tokens_per_s + output_tokens_per_s
    blended = price_per_million_tokens(costs.gpu_hourly_price, total_tokens_per_s / gpus)
    input_price = cost_per_s * prefill_gpu_share * PER_MILLION / input_tokens_per_s
    output_price = cost_per_s * (1 - prefill_gpu_share) * PER_MILLION / output_tokens_per_s
    seconds_per_year = 3600.0 * costs.hours_per_day * costs.days_per_year
    result = {
        "gpus": gpus,
        "gpu_hourly_price": costs.gpu_hourly_price,
        "cost_per_hour": cost_per_s * 3600.0,
        "prefill_gpu_share": prefill_gpu_share,
        "price_per_1m_tokens": blended,
        "price_per_1m_input_tokens": input_price,
        "price_per_1m_output_tokens": output_price,
        "cost_per_year": cost_per_s * seconds_per_year,
        "tokens_per_year_at_peak": total_tokens_per_s * seconds_per_year,
        "by_daily_utilization": [
            {"utilization": f, "price_per_1m_tokens": blended / f} for f in UTILIZATION_TABLE
        ],
        "api": None,
    }
    if costs.api_input_price is not None and costs.api_output_price is not None:
        api_per_s = (
            input_tokens_per_s * costs.api_input_price
            + output_tokens_per_s * costs.api_output_price
        ) / PER_MILLION
        result["api"] = {
            "price_per_1m_tokens_blended": api_per_s * PER_MILLION / total_tokens_per_s,
            "cost_per_year_at_peak": api_per_s * seconds_per_year,
            "break_even_utilization": cost_per_s / api_per_s,
            "self_hosting_cheaper_at_peak": cost_per_s < api_per_s,
        }
    return result
