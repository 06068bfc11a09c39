"""The next interval's load from the recent ones: smoothed rate and mean lengths."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.gateway.slo_types import Arrival, Forecast


class LoadForecaster:
    """Exponentially smoothed arrival rate and token rates, one update per interval.

    The forecast rate rises at once with the latest interval (a burst is answered in the
    interval it shows up) and falls only as fast as the smoothing lets it (one quiet
    interval is not taken for the end of the traffic). Mean lengths are smoothed token
    rates over the smoothed request rate, so an empty interval moves them not at all.
    """

    def __init__(self, alpha: float) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"forecast alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.rate: float | None = None
        self.prompt_rate = 0.0
        self.output_rate = 0.0
        self.latest_rate = 0.0

    def observe(self, arrivals: Sequence[Arrival], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"an interval lasts a positive time, got {interval_s}")
        rate = len(arrivals) / interval_s
        prompt_rate = sum(a.prompt_tokens for a in arrivals) / interval_s
        output_rate = sum(a.max_tokens for a in arrivals) / interval_s
        self.latest_rate = rate
        if self.rate is None:
            self.rate, self.prompt_rate, self.output_rate = rate, prompt_rate, output_rate
            return
        keep = 1.0 - self.alpha
        self.rate = keep * self.rate + self.alpha * rate
        if arrivals:
            # Lengths only learn from intervals that saw requests.
            self.prompt_rate = keep * self.prompt_rate + self.alpha * prompt_rate
            self.output_rate = keep * self.output_rate + self.alpha * output_rate
        else:
            self.prompt_rate *= keep
            self.output_rate *= keep

    def forecast(self) -> Forecast:
        smoothed = self.rate or 0.0
        if smoothed <= 0.0:
            return Forecast(rate=self.latest_rate, prompt_tokens=0.0, output_tokens=0.0)
        return Forecast(
            rate=max(smoothed, self.latest_rate),
            prompt_tokens=self.prompt_rate / smoothed,
            output_tokens=self.output_rate / smoothed,
        )
