"""Handoffs voided before they arrived: the decode role's small book of late arrivals."""

from __future__ import annotations

import time
from collections import OrderedDict

VOID_TTL_S = 600.0
MAX_VOIDED = 100_000


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
