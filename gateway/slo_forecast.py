"""The next interval's load from the recent ones: smoothed rate and mean lengths."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdserve.gateway.slo_types import Arrival, Forecast

# A count this many Poisson standard deviations over the smoothed one is a burst.
BURST_SIGMAS = 3.0


class LoadForecaster:
    """Exponentially smoothed request rate and token rates, one update per interval.

    An interval's weight is 1 - 0.5 ** (interval / half-life).
    The forecast is the smoothed rate, except when the newest interval's count is a
    burst (past `BURST_SIGMAS` Poisson deviations over the smoothed count): then the
    newest rate, so a burst is answered in the interval it shows up while ordinary
    Poisson noise moves nothing. Mean lengths are smoothed token rates over the smoothed
    request rate, so an empty interval moves them not at all.
    """

    def __init__(self, halflife_s: float) -> None:
        if halflife_s <= 0:
            raise ValueError(f"the forecast's half-life must be positive, got {halflife_s}")
        self.halflife_s = halflife_s
        self.rate: float | None = None
        self.prompt_rate = 0.0
        self.prompt_sq_rate = 0.0
        self.output_rate = 0.0
        self.burst_rate = 0.0  # the newest interval's rate when it was a burst, else 0

    def observe(self, arrivals: Sequence[Arrival], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"an interval lasts a positive time, got {interval_s}")
        rate = len(arrivals) / interval_s
        rates = (
            sum(a.prompt_tokens for a in arrivals) / interval_s,
            sum(a.prompt_tokens**2 for a in arrivals) / interval_s,
            sum(a.max_tokens for a in arrivals) / interval_s,
        )
        if self.rate is None:
            self.rate = rate
            self.prompt_rate, self.prompt_sq_rate, self.output_rate = rates
            return
        expected = self.rate * interval_s
        burst = len(arrivals) > expected + BURST_SIGMAS * math.sqrt(max(expected, 1.0))
        self.burst_rate = rate if burst else 0.0
        # The newest interval's weight follows its length, so the smoothing spans the
        # same time whatever the interval.
        keep = 0.5 ** (interval_s / self.halflife_s)
        new = 1.0 - keep
        self.rate = keep * self.rate + new * rate
        # An empty interval decays the token rates with the request rate, keeping means.
        self.prompt_rate = keep * self.prompt_rate + new * rates[0]
        self.prompt_sq_rate = keep * self.prompt_sq_rate + new * rates[1]
        self.output_rate = keep * self.output_rate + new * rates[2]

    def forecast(self) -> Forecast:
        smoothed = self.rate or 0.0
        if smoothed <= 0.0:
            return Forecast(rate=self.burst_rate, prompt_tokens=0.0, output_tokens=0.0)
        return Forecast(
            rate=max(smoothed, self.burst_rate),
            prompt_tokens=self.prompt_rate / smoothed,
            output_tokens=self.output_rate / smoothed,
            prompt_tokens_sq=self.prompt_sq_rate / smoothed,
        )
