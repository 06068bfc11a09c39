"""The next interval's load from the recent ones: smoothed rates per band of prompt lengths."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdserve.gateway.slo_types import Arrival, Forecast, LoadClass

# A count this many Poisson standard deviations off the smoothed one is not noise.
BURST_SIGMAS = 3.0
# A band of prompt lengths spans a factor of four ([64, 256), [256, 1024), ...): chat and
# retrieved-context prompts fall in different bands, so a phase of one after the other
# shows as one band rising from nothing instead of a mean length creeping up.
BAND_BITS = 2
# A band this rare (requests/s) is gone from the forecast.
NEGLIGIBLE_RATE = 1e-6

# (requests, prompt tokens, squared prompt tokens, output tokens) per second
Rates = tuple[float, float, float, float]
NO_RATES: Rates = (0.0, 0.0, 0.0, 0.0)


def band_of(prompt_tokens: int) -> int:
    return (max(prompt_tokens, 1).bit_length() - 1) // BAND_BITS


def rates_of(arrivals: Sequence[Arrival], interval_s: float) -> Rates:
    return (
        len(arrivals) / interval_s,
        sum(a.prompt_tokens for a in arrivals) / interval_s,
        sum(a.prompt_tokens**2 for a in arrivals) / interval_s,
        sum(a.max_tokens for a in arrivals) / interval_s,
    )


def blend(old: Rates, new: Rates, new_weight: float) -> Rates:
    a, b, c, d = (x * (1.0 - new_weight) + y * new_weight for x, y in zip(old, new, strict=True))
    return (a, b, c, d)


class BandSmoother:
    """One band's rates, exponentially smoothed, with bursts and level changes.

    An interval's weight is 1 - 0.5 ** (interval / half-life). An interval whose count is
    more than `BURST_SIGMAS` Poisson deviations over the smoothed count is a burst: the
    forecast takes it at once, while ordinary noise moves nothing. Two intervals in a row
    off the noise the same way (up or down) are a change of level: the smoothed rates
    jump to the two intervals' mean instead of creeping there over several half-lives.

    A band that starts from its first interval's rates (`intervals` 1) weighs each
    interval by the share of all it has seen, as a mean, until that share is down to the
    smoothing's: the first second's few requests are then one sample among several, not
    the level for half-lives to come. A band that starts from nothing (`intervals` 0)
    is smoothed from the start.
    """

    def __init__(self, level: Rates, intervals: int = 0) -> None:
        self.level = level
        self.burst: Rates | None = None  # the newest interval, when it was a burst
        self.off: tuple[int, Rates] | None = None  # the newest interval off the noise
        # Intervals behind the level, each weighed down by the smoothing (None: smoothed).
        self.seen: float | None = float(intervals) if intervals else None

    def observe(self, rates: Rates, count: int, interval_s: float, keep: float) -> None:
        expected = self.level[0] * interval_s
        noise = BURST_SIGMAS * math.sqrt(max(expected, 1.0))
        direction = 1 if count > expected + noise else -1 if count < expected - noise else 0
        self.burst = rates if direction > 0 else None
        if direction and self.off is not None and self.off[0] == direction:
            self.level = blend(self.off[1], rates, 0.5)
            self.off = None
            return
        self.off = (direction, rates) if direction else None
        # An empty interval decays the token rates with the request rate, keeping means.
        weight = 1.0 - keep
        if self.seen is not None:
            self.seen = self.seen * keep + 1.0
            weight = max(weight, 1.0 / self.seen)
        self.level = blend(self.level, rates, weight)

    def forecast(self) -> Rates:
        if self.burst is not None and self.burst[0] > self.level[0]:
            return self.burst
        return self.level


class LoadForecaster:
    """The expected load per band of prompt lengths, one update per interval.

    Mean lengths are smoothed token rates over the smoothed request rate, so an empty
    interval moves them not at all. A band first seen after the first interval starts
    from nothing: one long prompt is not a rate of one a second.
    """

    def __init__(self, halflife_s: float) -> None:
        if halflife_s <= 0:
            raise ValueError(f"the forecast's half-life must be positive, got {halflife_s}")
        self.halflife_s = halflife_s
        self.bands: dict[int, BandSmoother] = {}
        self.started = False
        self.arrivals = 0  # requests seen: what the forecast rests on

    def observe(self, arrivals: Sequence[Arrival], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"an interval lasts a positive time, got {interval_s}")
        by_band: dict[int, list[Arrival]] = {}
        for arrival in arrivals:
            by_band.setdefault(band_of(arrival.prompt_tokens), []).append(arrival)
        if not self.started:
            self.bands = {
                b: BandSmoother(rates_of(m, interval_s), intervals=1) for b, m in by_band.items()
            }
            self.started = True
            self.arrivals += len(arrivals)
            return
        self.arrivals += len(arrivals)
        for band in by_band:
            self.bands.setdefault(band, BandSmoother(NO_RATES))
        # The newest interval's weight follows its length, so the smoothing spans the same
        # time whatever the interval.
        keep = 0.5 ** (interval_s / self.halflife_s)
        for band, smoother in self.bands.items():
            members = by_band.get(band, [])
            smoother.observe(rates_of(members, interval_s), len(members), interval_s, keep)

    def forecast(self) -> Forecast:
        classes = []
        totals = [0.0, 0.0, 0.0, 0.0]
        for band in sorted(self.bands):
            rates = self.bands[band].forecast()
            if rates[0] < NEGLIGIBLE_RATE:
                continue
            rate, prompt, square, output = rates
            classes.append(LoadClass(rate, prompt / rate, output / rate, square / rate))
            totals = [t + r for t, r in zip(totals, rates, strict=True)]
        rate = totals[0]
        if rate <= 0.0:
            return Forecast(rate=0.0, prompt_tokens=0.0, output_tokens=0.0)
        return Forecast(
            rate=rate,
            prompt_tokens=totals[1] / rate,
            output_tokens=totals[3] / rate,
            prompt_tokens_sq=totals[2] / rate,
            classes=tuple(classes),
        )
