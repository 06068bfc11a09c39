"""How this decode instance's recent handoffs ended: their KV pulled, or the pull failed
and the prompt was recomputed here (or the request failed, under `--kv-failure-policy
fail`). A decode instance whose pulls keep failing still serves every request, each
computed twice; this window is what says so, in its stats (`InstanceStats.kv_pulls_*`:
the gateway's `/health` and `pdserve:kv_pull_recompute_ratio`), beside the log line of
each request."""

from __future__ import annotations

from collections import deque

from pdserve.common.messages import InstanceStats

WINDOW = 32  # handoffs whose pull ended, the latest
_REASON_CHARS = 300  # a reason is one line; a long one is cut for /health


class PullOutcomes:
    def __init__(self, window: int = WINDOW) -> None:
        # (recomputed, the pull's failure or "") of each handoff whose pull ended
        self._ends: deque[tuple[bool, str]] = deque(maxlen=window)

    def pulled(self) -> None:
        self._ends.append((False, ""))

    def failed(self, reason: str, recomputed: bool) -> None:
        self._ends.append((recomputed, reason[:_REASON_CHARS] or "unknown"))

    def add_stats(self, stats: InstanceStats) -> None:
        stats.kv_pulls_recent = len(self._ends)
        stats.kv_pulls_recomputed = sum(recomputed for recomputed, _ in self._ends)
        failures = [reason for _, reason in self._ends if reason]
        stats.kv_pull_last_failure = failures[-1] if failures else ""
