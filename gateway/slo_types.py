"""The SLO policy's typed seam: what it observes, forecasts and decides, and its settings."""

from __future__ import annotations

from typing import Literal

import msgspec

Action = Literal["hold", "switch", "start", "stop"]


class PoolObservation(msgspec.Struct, frozen=True):
    """One pool (prefill or decode) as the gateway saw it at the end of the interval."""

    serving: int  # instances that take requests (not loading, draining or switching)
    starting: int  # instances loading or switching into this pool
    queued: int  # requests waiting for this pool's compute
    running: int  # requests this pool computes now
    kv_usage: float  # mean fraction of KV blocks in use, 0..1


class Arrival(msgspec.Struct, frozen=True):
    """A request that arrived during the interval."""

    prompt_tokens: int
    max_tokens: int  # the request's output bound (max_tokens, else the context left)


class Observation(msgspec.Struct, frozen=True):
    at: float  # seconds on the controller's clock when taken
    interval_s: float  # how long the interval was
    prefill: PoolObservation
    decode: PoolObservation
    ttft_ms: tuple[float, ...]  # TTFT of each request whose first token came in the interval
    itl_ms: tuple[float, ...]  # inter-token gaps seen in the interval (a bounded sample)
    arrivals: tuple[Arrival, ...]
    operator_change: bool  # an admin drain, scale or role switch is in flight
    # How old the freshest report behind the pools' figures is (seconds): instances that
    # stopped reporting leave figures that no longer describe the pools.
    data_age_s: float = 0.0


class LoadClass(msgspec.Struct, frozen=True):
    """The expected requests of one band of prompt lengths."""

    rate: float  # requests per second
    prompt_tokens: float  # mean per request
    output_tokens: float  # mean per request
    prompt_tokens_sq: float  # mean of the squared prompt lengths


class Forecast(msgspec.Struct, frozen=True):
    """The load the policy expects over the next interval."""

    rate: float  # requests per second
    prompt_tokens: float  # mean per request
    output_tokens: float  # mean per request
    # Mean of the squared prompt lengths: a mix of short and long prompts queues longer
    # than prompts of its mean length (0: unknown, taken as prompt_tokens squared).
    prompt_tokens_sq: float = 0.0
    # The same per band of prompt lengths (`slo_forecast.py`): a mix of chat and RAG
    # prompts costs the prefill pool what each band costs, not what its mean length would.
    # Empty: one band, the totals above.
    classes: tuple[LoadClass, ...] = ()

    def by_class(self) -> tuple[LoadClass, ...]:
        if self.classes:
            return self.classes
        square = self.prompt_tokens_sq or self.prompt_tokens**2
        return (LoadClass(self.rate, self.prompt_tokens, self.output_tokens, square),)


class Decision(msgspec.Struct, frozen=True):
    at: float
    action: Action
    reason: str  # a short label, also the metric's `reason` (e.g. "ttft_risk", "stale")
    detail: str  # one line for the log and `GET /admin/controller`
    target_prefill: int  # the split the policy wants
    target_decode: int
    role_from: str | None = None  # switch: the pool that gives an instance
    role_to: str | None = None  # switch: the pool that takes it; start/stop: the pool
    forecast: Forecast | None = None
    headroom: float | None = None  # the target split's predicted headroom (min SLO margin)
    count: int = 1  # switch: how many instances move from role_from to role_to at once


class PolicyConfig(msgspec.Struct, frozen=True):
    instance_budget: int
    ttft_slo_ms: float
    itl_slo_ms: float
    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None
    interval_s: float = 5.0
    # Hysteresis: a target must beat the current split's headroom by this much ...
    switch_margin: float = 0.1
    # ... and want the same direction for this many consecutive intervals.
    persist_intervals: int = 2
    cooldown_intervals: int = 2  # the next move comes no sooner than this many intervals
    stale_intervals: float = 3.0  # older data, or a gap this long between observations
    forecast_halflife_s: float = 15.0  # the smoothed load forgets half its past in this time
    # No move before the forecast rests on this many requests: a first second's two or
    # three arrivals say little about the rate (a Poisson count of 10 is within ~30 %).
    min_arrivals: int = 10
    # What an instance does per step, as the engine is configured (the latency model's
    # inputs): prompt tokens per prefill step, sequences per decode step.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_usage_limit: float = 0.9  # a decode pool predicted above this is at risk
    # The most instances one switch decision moves (0: a sixteenth of the budget, at
    # least one). A switch takes about the same time however many move together, so a
    # large budget crosses a phase change in a few intervals instead of one per instance.
    max_switches: int = 0

    def switch_batch(self) -> int:
        """How many instances one switch decision may move."""
        return self.max_switches or max(1, self.instance_budget // 16)

    def check(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        if self.min_prefill < 1 or self.min_decode < 1:
            raise ValueError("min_prefill and min_decode must be at least 1")
        if self.instance_budget < self.min_prefill + self.min_decode:
            raise ValueError(
                f"instance_budget {self.instance_budget} is below min_prefill + min_decode "
                f"({self.min_prefill + self.min_decode})"
            )
        for name, low, high in (
            ("prefill", self.min_prefill, self.max_prefill),
            ("decode", self.min_decode, self.max_decode),
        ):
            if high is not None and high < low:
                raise ValueError(f"max_{name} {high} is below min_{name} {low}")
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise ValueError("the TTFT and ITL SLOs must be positive")
        if self.forecast_halflife_s <= 0:
            raise ValueError("forecast_halflife_s must be positive")
        if self.interval_s <= 0 or self.stale_intervals <= 1:
            raise ValueError("interval_s must be positive and stale_intervals above 1")
        if self.persist_intervals < 1 or self.cooldown_intervals < 0:
            raise ValueError("persist_intervals must be >= 1 and cooldown_intervals >= 0")
        if self.min_arrivals < 0:
            raise ValueError("min_arrivals must be >= 0")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
