"""How many frames each channel of this process dropped, and why (`pdserve:dropped_frames_total`).

One process-wide book: every `Sealer` (and every receiver that drops a frame for its
shape) counts here, so a flood of junk is seen in `/metrics` and never ends a group or
fences an instance. The gateway exports its own book; an instance ships what it
counted since its previous output (`MetricsDelta.dropped_frames`), and the rank
processes of a worker group hand theirs to its driver with every step's result
(`StepResult.dropped_frames`), where they join the instance's book.
"""

from __future__ import annotations

import threading

# Why a frame was dropped (the `reason` label).
OVERSIZED = "oversized"  # larger than its channel's limit: never hashed
MALFORMED = "malformed"  # no header, a bad header, or the wrong number of parts
BAD_MAC = "bad_mac"  # the tag does not match (no secret, another channel or direction)
REPLAY = "replay"  # a sequence number its sender already used
IDENTITY = "identity"  # sealed under another name than the socket's peer
UNDECODABLE = "undecodable"  # a valid seal around bytes that do not decode
# From or for a life of an instance retired since: a handoff, a task, a KV control message.
STALE_EPOCH = "stale_epoch"


class FrameDrops:
    """Counts by (channel, reason); thread-safe (I/O threads and the event loop count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._shipped: dict[tuple[str, str], int] = {}

    def count(self, channel: str, reason: str, frames: int = 1) -> None:
        """`frames` > 1: another process's drops joining this book (a rank's, at its driver)."""
        with self._lock:
            key = (channel, reason)
            self._counts[key] = self._counts.get(key, 0) + frames

    def totals(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def has_new(self) -> bool:
        with self._lock:
            return self._counts != self._shipped

    def take_new(self) -> dict[tuple[str, str], int]:
        """What was counted since the previous call (for an instance's next output)."""
        with self._lock:
            new = {k: n - self._shipped.get(k, 0) for k, n in self._counts.items()}
            self._shipped = dict(self._counts)
        return {k: n for k, n in new.items() if n}


DROPS = FrameDrops()  # this process's
