"""What split of the instance budget the SLOs want next: one pure decision per interval.

The policy reads one `Observation` (what the gateway saw over the last interval), forecasts
the next interval's load, asks the calibrated step-latency model (`planner/sim`) which
prefill:decode split of the budget meets the TTFT and ITL objectives with the most
headroom, and answers one `Decision`. It does no I/O and reads no clock: the controller
(`gateway/slo_controller.py`) and the simulator drive it alike.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pdserve.planner.sim.latency import Calibration

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


class Forecast(msgspec.Struct, frozen=True):
    """The load the policy expects over the next interval."""

    rate: float  # requests per second
    prompt_tokens: float  # mean per request
    output_tokens: float  # mean per request


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


class PolicyConfig(msgspec.Struct, frozen=True):
    instance_budget: int
    ttft_slo_ms: float
    itl_slo_ms: float
    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None
    interval_s: float = 5.0


class SloPolicy:
    """Decides each interval's move from an `Observation` and the step-latency model."""

    def __init__(self, config: PolicyConfig, calibration: Calibration) -> None:
        self.config = config
        self.calibration = calibration

    def decide(self, observation: Observation) -> Decision:
        raise NotImplementedError("the policy is being written")
