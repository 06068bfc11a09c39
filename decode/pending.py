"""Small books of the decode kind: handoffs voided before they arrived, and pulls held
back by the test-only transfer delay."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

# Test only: every pull starts this many seconds after its blocks were allocated, so
# tests can tell the first token (from the prefill instance) from the rest.
TEST_DELAY_ENV = "PDSERVE_TEST_KV_DELAY_S"
VOID_TTL_S = 600.0
MAX_VOIDED = 100_000


def injected_delay_s(environ: dict[str, str] | None = None) -> float:
    """The test-only pull delay from the environment (0: none); bad values fail loudly."""
    text = (environ if environ is not None else os.environ).get(TEST_DELAY_ENV, "")
    if not text:
        return 0.0
    try:
        delay = float(text)
    except ValueError:
        raise ValueError(f"{TEST_DELAY_ENV} must be a number of seconds, got {text!r}") from None
    if delay < 0:
        raise ValueError(f"{TEST_DELAY_ENV} must be >= 0, got {delay}")
    return delay


class VoidedHandoffs:
    """(request id, prefill instance) pairs the gateway aborted before their handoff
    arrived here; such a late handoff is dropped when it comes (the prefill instance
    got the abort too and frees its blocks). Entries age out."""

    def __init__(self, ttl_s: float = VOID_TTL_S, limit: int = MAX_VOIDED) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._entries: OrderedDict[tuple[str, str], float] = OrderedDict()

    def add(self, request_id: str, prefill_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._entries[(request_id, prefill_id)] = now + self.ttl_s
        self._entries.move_to_end((request_id, prefill_id))
        while self._entries:
            key, expiry = next(iter(self._entries.items()))
            if expiry > now and len(self._entries) <= self.limit:
                break
            del self._entries[key]

    def consume(self, request_id: str, prefill_id: str, now: float | None = None) -> bool:
        """True (once) if this handoff was voided."""
        now = time.monotonic() if now is None else now
        expiry = self._entries.pop((request_id, prefill_id), None)
        return expiry is not None and expiry > now

    def __len__(self) -> int:
        return len(self._entries)


class DelayedPulls:
    """Allocations whose pull starts after `delay_s` (0: at once)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self._queue: list[tuple[float, Any]] = []

    def add(self, allocation: Any, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._queue.append((now + self.delay_s, allocation))

    def pop_due(self, now: float | None = None) -> list[Any]:
        now = time.monotonic() if now is None else now
        due = [a for t, a in self._queue if t <= now]
        self._queue = [(t, a) for t, a in self._queue if t > now]
        return due

    def drop(self, request_id: str) -> None:
        self._queue = [(t, a) for t, a in self._queue if a.request_id != request_id]

    def __len__(self) -> int:
        return len(self._queue)
