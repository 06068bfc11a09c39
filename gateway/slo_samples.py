"""What the SLO controller reads of the traffic: TTFTs, inter-token gaps and arrivals
since its last look, each in bounded memory."""

from __future__ import annotations

import random

from pdserve.gateway.slo_policy import Arrival

TTFT_SAMPLES = 1024  # first tokens kept per interval (a uniform sample beyond that)
ITL_SAMPLES = 4096  # inter-token gaps kept per interval
# Arrivals are kept whole up to this many per interval, so their count is the rate; a
# gateway admits far fewer in an interval of seconds.
MAX_ARRIVALS = 65536


class Reservoir:
    """A uniform sample of at most `capacity` values out of all added since `take`
    (Vitter's algorithm R: each value is kept with probability capacity / seen)."""

    def __init__(self, capacity: int, rng: random.Random) -> None:
        self.capacity = capacity
        self._rng = rng
        self._values: list[float] = []
        self._seen = 0

    def add(self, value: float) -> None:
        self._seen += 1
        if len(self._values) < self.capacity:
            self._values.append(value)
            return
        slot = self._rng.randrange(self._seen)
        if slot < self.capacity:
            self._values[slot] = value

    def take(self) -> tuple[float, ...]:
        """The sample so far; the next one starts empty."""
        values = tuple(self._values)
        self._values.clear()
        self._seen = 0
        return values


class SloSamples:
    """Fed on the event loop by each run (`GenerationRun`, `Gateway.start_run`); read
    and emptied once per interval by `SloController`."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(seed)  # a fixed seed: which gaps are kept needs no secrecy
        self._ttft_ms = Reservoir(TTFT_SAMPLES, rng)
        self._itl_ms = Reservoir(ITL_SAMPLES, rng)
        self._arrivals: list[Arrival] = []
        self.arrivals_dropped = 0  # past MAX_ARRIVALS in the current interval

    def add_ttft(self, seconds: float) -> None:
        self._ttft_ms.add(seconds * 1000.0)

    def add_gap(self, seconds: float) -> None:
        self._itl_ms.add(seconds * 1000.0)

    def add_arrival(self, prompt_tokens: int, max_tokens: int) -> None:
        if len(self._arrivals) >= MAX_ARRIVALS:
            self.arrivals_dropped += 1
            return
        self._arrivals.append(Arrival(prompt_tokens, max_tokens))

    def take(self) -> tuple[tuple[float, ...], tuple[float, ...], tuple[Arrival, ...]]:
        """TTFTs (ms), inter-token gaps (ms) and arrivals since the last `take`."""
        arrivals = tuple(self._arrivals)
        self._arrivals.clear()
        self.arrivals_dropped = 0
        return self._ttft_ms.take(), self._itl_ms.take(), arrivals
