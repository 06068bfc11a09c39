"""Late handoffs: voided before they arrived, or from a retired epoch (the decode role's books)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from pdserve.common.frame_drops import DROPS, STALE_EPOCH

VOID_TTL_S = 600.0
MAX_VOIDED = 100_000
MAX_SOURCES = 10_000  # prefill instances whose latest epoch is kept

logger = logging.getLogger(__name__)


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


class SourceEpochs:
    """The latest epoch heard from each prefill instance in its handoffs. A handoff from
    an earlier one comes from an instance the gateway retired (fenced, then replaced)
    that went on before it was killed: the gateway moved its requests on, so it is
    dropped and counted (`pdserve:dropped_frames_total{channel="tasks"}`)."""

    def __init__(self, limit: int = MAX_SOURCES) -> None:
        self.limit = limit
        self._latest: OrderedDict[str, int] = OrderedDict()

    def admit(self, prefill_id: str, epoch: int) -> bool:
        latest = self._latest.get(prefill_id)
        if latest is not None and epoch < latest:
            DROPS.count("tasks", STALE_EPOCH)
            logger.warning(
                "dropping a handoff of %s's epoch %d (epoch %d heard)", prefill_id, epoch, latest
            )
            return False
        self._latest[prefill_id] = epoch
        self._latest.move_to_end(prefill_id)
        if len(self._latest) > self.limit:
            self._latest.popitem(last=False)
        return True
