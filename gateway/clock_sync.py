"""Each instance's clock offset from the gateway's, bounded from both sides by messages.

An instance reports its timings on its own wall clock; the gateway places them on its
own by adding the instance's offset θ (gateway time = instance time + θ). Two kinds of
observation bound θ, as NTP's four timestamps do with the round trip split in two:
- every output carries the instance's clock as it was made (`InstanceOutput.sent_at`)
  and is received later, so θ ≤ received − sent_at (the upper bound);
- an event an instance reports happened after something the gateway (or an instance
  already placed) did first: a request is queued after the gateway sent it, a handoff
  arrives after its prefill instance sampled the first token, so θ ≥ before − event
  (the lower bound).
The estimate is the middle of the tightest bounds of the last one or two windows (a
window ages out, so drift is followed); the error is half the interval's width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 30.0  # bounds older than two windows no longer count


@dataclass(frozen=True)
class Offset:
    """θ in seconds and its uncertainty (None: no lower bound seen, θ is the upper one)."""

    seconds: float
    error_s: float | None


class _Tightest:
    """The best of a bound's samples over the current and the previous window."""

    def __init__(self, pick: Callable[[float, float], float]) -> None:
        self._pick = pick
        self._current: float | None = None
        self._previous: float | None = None
        self._since = float("-inf")

    def add(self, value: float, now: float) -> None:
        if now - self._since >= WINDOW_S:
            self._previous, self._current, self._since = self._current, None, now
        self._current = value if self._current is None else self._pick(self._current, value)

    @property
    def value(self) -> float | None:
        known = [v for v in (self._current, self._previous) if v is not None]
        if not known:
            return None
        best = known[0]
        for other in known[1:]:
            best = self._pick(best, other)
        return best


class _Bounds:
    def __init__(self) -> None:
        self.upper = _Tightest(min)
        self.lower = _Tightest(max)


class ClockSync:
    """The gateway's estimate of every instance's clock offset."""

    def __init__(self) -> None:
        self._bounds: dict[str, _Bounds] = {}

    def observe_output(self, instance_id: str, sent_at: float, received: float) -> None:
        """An output made at `sent_at` (the instance's clock) came in at `received`."""
        if sent_at > 0:
            self._of(instance_id).upper.add(received - sent_at, received)

    def observe_after(self, instance_id: str, event: float, before: float) -> None:
        """Something at `event` (the instance's clock) happened after `before` (the
        gateway's clock, or another instance's event already placed on it)."""
        self._of(instance_id).lower.add(before - event, before)

    def offset(self, instance_id: str) -> Offset:
        bounds = self._bounds.get(instance_id)
        upper = bounds.upper.value if bounds else None
        lower = bounds.lower.value if bounds else None
        if upper is None and lower is None:
            return Offset(0.0, None)  # never heard from: one clock assumed
        if upper is None or lower is None:
            return Offset(upper if upper is not None else lower or 0.0, None)
        return Offset((upper + lower) / 2, abs(upper - lower) / 2)

    def to_gateway(self, instance_id: str, instance_time: float) -> float:
        return instance_time + self.offset(instance_id).seconds

    def forget(self, instance_id: str) -> None:
        self._bounds.pop(instance_id, None)

    def _of(self, instance_id: str) -> _Bounds:
        bounds = self._bounds.get(instance_id)
        if bounds is None:
            bounds = self._bounds[instance_id] = _Bounds()
        return bounds
