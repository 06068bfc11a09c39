"""The scheduler half of the connector, one per instance (on its leader).

It decides, the workers do. Each step the instance collects `build_metadata()` and
hands it to every TP rank's `KVTransferWorker.apply`, then feeds the (aggregated)
`TransferReport` back through `update()`, which says what to do with each request.
Neither half calls the step scheduler: the instance does, with what `update` returns.

Prefill side: `hand_off` turns a request whose first token is out into the handoff
message and holds its blocks; `update` says which held requests may release them.

Decode side: `admit` checks a handoff (layout, TP split) before anything is
allocated and says how many tokens come from remote; `on_allocation` maps the local
blocks the scheduler allocated onto P's, skipping the local prefix-cache hits;
`update` says which requests leave WAITING_FOR_REMOTE_KVS, and how.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from pdserve.kvtransfer.config import FAILURE_POLICIES
from pdserve.kvtransfer.layout import check_compatible, check_tp_split
from pdserve.kvtransfer.messages import (
    HoldSpec,
    KeepaliveSpec,
    KVConnectorMetadata,
    KVHandoff,
    KVLayout,
    KVSource,
    PullSpec,
    TransferReport,
)

if TYPE_CHECKING:
    from pdserve.common.request import Request


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class PrefillUpdate:
    released: list[str] = field(default_factory=list)  # D has the KV: blocks → prefix cache
    expired: list[str] = field(default_factory=list)  # lease ran out: free the blocks
    aborted: list[str] = field(default_factory=list)  # aborted: free the blocks


class _WorkerCommands:
    """The commands queued for the ranks' workers until the next step's metadata."""

    def __init__(self) -> None:
        self._pending = KVConnectorMetadata()

    def build_metadata(self) -> KVConnectorMetadata:
        metadata, self._pending = self._pending, KVConnectorMetadata()
        return metadata


class PrefillKVScheduler(_WorkerCommands):
    def __init__(self, instance_id: str, layout: KVLayout, rank_addresses: list[str]):
        super().__init__()
        tp_size = len(rank_addresses) // layout.pipeline_parallel_size
        check_tp_split(layout, tp_size, f"instance {instance_id}")
        self.instance_id = instance_id
        self.layout = layout
        self.rank_addresses = list(rank_addresses)
        self._held: set[str] = set()
        self.lease_expiries = 0

    @property
    def held_request_ids(self) -> set[str]:
        return set(self._held)

    def hand_off(
        self,
        request: Request,
        block_ids: list[int],
        first_token_id: int,
        first_token_logprob: float | None = None,
        first_token_top_logprobs: dict[int, float] | None = None,
    ) -> KVHandoff:
        """Hold the request's prompt blocks and build the handoff for the decode side.
        Apply this step's metadata to the workers before sending the handoff on."""
        rid = request.request_id
        if rid in self._held:
            raise ValueError(f"request {rid} is already handed off")
        needed = _blocks_for(len(request.prompt_token_ids), self.layout.block_size)
        if len(block_ids) < needed:
            raise ValueError(
                f"request {rid}: {len(block_ids)} blocks cannot hold "
                f"{len(request.prompt_token_ids)} prompt tokens"
            )
        prompt_blocks = list(block_ids[:needed])
        self._held.add(rid)
        self._pending.holds.append(HoldSpec(rid, prompt_blocks))
        return KVHandoff(
            request_id=rid,
            prompt_token_ids=list(request.prompt_token_ids),
            first_token_id=first_token_id,
            first_token_logprob=first_token_logprob,
            first_token_top_logprobs=dict(first_token_top_logprobs or {}),
            # The seed P sampled with (drawn here if the client set none): D continues it.
            sampling_params=msgspec.structs.replace(request.sampling_params, seed=request.seed),
            eos_token_ids=sorted(request.eos_token_ids),
            cache_salt=request.cache_salt,
            source=KVSource(self.instance_id, self.rank_addresses, prompt_blocks, self.layout),
        )

    def abort(self, request_id: str) -> None:
        if request_id in self._held:
            self._pending.aborts.append(request_id)

    def update(self, report: TransferReport) -> PrefillUpdate:
        """Each returned id is free to release now (no send reads its blocks)."""
        update = PrefillUpdate()
        for ids, out in (
            (report.finished_sending, update.released),
            (report.expired, update.expired),
            (report.aborted, update.aborted),
        ):
            for rid in ids:
                if rid in self._held:
                    self._held.discard(rid)
                    out.append(rid)
        self.lease_expiries += len(update.expired)
        return update


@dataclass
class RemoteKVFailure:
    request_id: str
    reason: str
    policy: str  # "recompute" or "fail": what StepScheduler.finish_remote_kvs is told


@dataclass
class DecodeUpdate:
    ready: list[str] = field(default_factory=list)  # finish_remote_kvs(id, success=True)
    failed: list[RemoteKVFailure] = field(default_factory=list)  # success=False + policy
    aborted: list[str] = field(default_factory=list)  # no transfer touches them: free


class DecodeKVScheduler(_WorkerCommands):
    def __init__(self, layout: KVLayout, tp_size: int = 1, failure_policy: str = "recompute"):
        super().__init__()
        if failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"failure_policy must be one of {FAILURE_POLICIES}, got {failure_policy!r}"
            )
        check_tp_split(layout, tp_size, "this decode instance")
        self.layout = layout
        self.tp_size = tp_size
        self.failure_policy = failure_policy
        self._handoffs: dict[str, KVHandoff] = {}
        self._no_pull: list[str] = []  # allocated with every block cached locally

    def admit(self, handoff: KVHandoff) -> int:
        """Check the handoff before anything is allocated; returns how many tokens'
        KV come from remote (`StepScheduler.add_remote_request`'s num_remote_tokens).
        Raises KVLayoutMismatch (a ValueError) with a one-line reason."""
        source = handoff.source
        name = f"prefill instance {source.instance_id}"
        check_compatible(self.layout, source.layout, name)
        check_tp_split(source.layout, source.tp_size, name)
        needed = _blocks_for(handoff.num_prompt_tokens, self.layout.block_size)
        if handoff.num_prompt_tokens < 1 or len(source.block_ids) != needed:
            raise ValueError(
                f"request {handoff.request_id}: {len(source.block_ids)} source blocks "
                f"for {handoff.num_prompt_tokens} prompt tokens"
            )
        if handoff.request_id in self._handoffs:
            raise ValueError(f"request {handoff.request_id} is already admitted")
        self._handoffs[handoff.request_id] = handoff
        self._pending.keepalives.append(KeepaliveSpec(handoff.request_id, source))
        return handoff.num_prompt_tokens

    def on_allocation(self, allocation: Any) -> int | None:
        """Blocks were allocated (`RemoteKVAllocation`: request_id, block_ids,
        num_local_cached_tokens). Queues the pull of the blocks the local prefix cache
        lacks; returns how many blocks will be pulled. None if the request already
        ended here (a handshake failure or an abort reported by `update` while it was
        queued): nothing is pulled, and the caller frees what it just allocated."""
        rid = allocation.request_id
        handoff = self._handoffs.get(rid)
        if handoff is None:
            return None
        skip = allocation.num_local_cached_tokens // self.layout.block_size
        src = handoff.source.block_ids[skip:]
        dst = list(allocation.block_ids[skip : skip + len(src)])
        if len(dst) < len(src):
            raise ValueError(
                f"request {rid}: {len(allocation.block_ids)} local blocks for "
                f"{len(handoff.source.block_ids)} remote ones"
            )
        # An empty pull still goes out: it tells P to release its blocks.
        self._pending.pulls.append(PullSpec(rid, handoff.source, src, dst))
        return len(src)

    def abort(self, request_id: str) -> None:
        if request_id in self._handoffs:
            self._pending.aborts.append(request_id)

    def handoff(self, request_id: str) -> KVHandoff | None:
        return self._handoffs.get(request_id)

    def update(self, report: TransferReport) -> DecodeUpdate:
        update = DecodeUpdate()
        for rid in report.finished_recving:
            if self._handoffs.pop(rid, None) is not None:
                update.ready.append(rid)
        for rid, reason in report.failed.items():
            if self._handoffs.pop(rid, None) is not None:
                update.failed.append(RemoteKVFailure(rid, reason, self.failure_policy))
        for rid in report.aborted:
            if self._handoffs.pop(rid, None) is not None:
                update.aborted.append(rid)
        return update


class ReportAggregator:
    """Merges the reports of a TP group's ranks: a request is reported once every
    rank is done with it, so no rank still moves its blocks."""

    _P_ORDER = ("expired", "aborted", "finished_sending")  # worst outcome wins
    _D_ORDER = ("aborted", "failed", "finished_recving")

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._outcomes: dict[str, dict[int, tuple[str, str]]] = {}
        self._quarantined: dict[int, list[str]] = {}

    def add(self, rank: int, report: TransferReport) -> None:
        for kind in ("finished_sending", "expired", "finished_recving", "aborted"):
            for rid in getattr(report, kind):
                self._outcomes.setdefault(rid, {})[rank] = (kind, "")
        for rid, reason in report.failed.items():
            self._outcomes.setdefault(rid, {})[rank] = ("failed", reason)
        self._quarantined[rank] = list(report.quarantined)

    def pop(self) -> TransferReport:
        merged = TransferReport()
        for rid, by_rank in list(self._outcomes.items()):
            if len(by_rank) < self.world_size:
                continue
            del self._outcomes[rid]
            kinds = {kind for kind, _ in by_rank.values()}
            prefill_side = bool(kinds & {"expired", "finished_sending"})
            order = self._P_ORDER if prefill_side else self._D_ORDER
            kind = next(k for k in order if k in kinds)
            if kind == "failed":
                merged.failed[rid] = next(r for k, r in by_rank.values() if k == "failed")
            else:
                getattr(merged, kind).append(rid)
        merged.quarantined = sorted({rid for ids in self._quarantined.values() for rid in ids})
        return merged
