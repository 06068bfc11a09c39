"""What the driver does with its ranks' transfer reports: a TP group's are merged, so a
request is reported once every rank is done with it."""

from __future__ import annotations

from pdserve.common.messages import KVPullTimes
from pdserve.kvtransfer.messages import TransferReport


class ReportAggregator:
    """Merges the reports of a TP group's ranks: a request is reported once every
    rank is done with it, so no rank still moves its blocks."""

    _P_ORDER = ("expired", "aborted", "finished_sending")  # worst outcome wins
    _D_ORDER = ("aborted", "failed", "finished_recving")

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._outcomes: dict[str, dict[int, tuple[str, str]]] = {}
        self._quarantined: dict[int, list[str]] = {}
        self._pulls: dict[str, list[KVPullTimes]] = {}

    def add(self, rank: int, report: TransferReport) -> None:
        for kind in ("finished_sending", "expired", "finished_recving", "aborted"):
            for rid in getattr(report, kind):
                self._outcomes.setdefault(rid, {})[rank] = (kind, "")
        for rid, reason in report.failed.items():
            self._outcomes.setdefault(rid, {})[rank] = ("failed", reason)
        self._quarantined[rank] = list(report.quarantined)
        for rid, pull in report.pulls.items():
            self._pulls.setdefault(rid, []).append(pull)

    def pop(self) -> TransferReport:
        merged = TransferReport()
        for rid, by_rank in list(self._outcomes.items()):
            if len(by_rank) < self.world_size:
                continue
            del self._outcomes[rid]
            pulls = self._pulls.pop(rid, [])
            kinds = {kind for kind, _ in by_rank.values()}
            sending = bool(kinds & {"expired", "finished_sending"})
            order = self._P_ORDER if sending else self._D_ORDER
            kind = next(k for k in order if k in kinds)
            if kind == "failed":
                merged.failed[rid] = next(r for k, r in by_rank.values() if k == "failed")
            else:
                getattr(merged, kind).append(rid)
            if kind == "finished_recving" and len(pulls) == self.world_size:
                merged.pulls[rid] = merge_pulls(pulls)
        merged.quarantined = sorted({rid for ids in self._quarantined.values() for rid in ids})
        return merged


def merge_pulls(pulls: list[KVPullTimes]) -> KVPullTimes:
    """One request's pull over every rank: from the first rank's start to the last
    rank's end, every rank's bytes."""
    return KVPullTimes(
        started=min(p.started for p in pulls),
        ended=max(p.ended for p in pulls),
        num_bytes=sum(p.num_bytes for p in pulls),
        transport=pulls[0].transport,
    )
