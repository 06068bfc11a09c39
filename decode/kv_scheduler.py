"""The decode role's half of the KV connector, on the instance's driver.

It decides, the ranks' transfer workers do. Each step the role collects
`build_metadata()`, which reaches every rank with the step's plan; the (aggregated)
`TransferReport` comes back through `update()`, which says what to do with each request.
It never calls the step scheduler: the role does, with what `update` returns.

`admit` checks a handoff (layout, TP split) before anything is allocated and says how
many tokens come from remote; `on_allocation` maps the local blocks the scheduler
allocated onto P's, skipping the local prefix-cache hits; `update` says which requests
leave WAITING_FOR_REMOTE_KVS, and how.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.common.messages import KVPullTimes
from pdserve.kvtransfer.config import FAILURE_POLICIES
from pdserve.kvtransfer.layout import blocks_for, check_compatible, check_tp_split
from pdserve.kvtransfer.messages import (
    KeepaliveSpec,
    KVConnectorMetadata,
    KVHandoff,
    KVLayout,
    PullSpec,
    TransferReport,
)


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
    pulls: dict[str, KVPullTimes] = field(default_factory=dict)  # of the ready ones


class DecodeKVScheduler:
    def __init__(
        self,
        layout: KVLayout,
        tp_size: int = 1,
        failure_policy: str = "recompute",
        epoch: int = 0,
    ):
        """`epoch`: the instance's, which its ranks' control messages carry."""
        self.epoch = epoch
        self._pending = KVConnectorMetadata(epoch=epoch)  # for the ranks, until the next step
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

    def build_metadata(self) -> KVConnectorMetadata:
        """The commands queued for the ranks' transfer workers since the last step."""
        metadata, self._pending = self._pending, KVConnectorMetadata(epoch=self.epoch)
        return metadata

    def admit(self, handoff: KVHandoff) -> int:
        """Check the handoff before anything is allocated; returns how many tokens'
        KV come from remote (`StepScheduler.add_remote_request`'s num_remote_tokens).
        Raises KVLayoutMismatch (a ValueError) with a one-line reason."""
        source = handoff.source
        name = f"prefill instance {source.instance_id}"
        check_compatible(self.layout, source.layout, name)
        check_tp_split(source.layout, source.tp_size, name)
        needed = blocks_for(handoff.num_prompt_tokens, self.layout.block_size)
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
                if rid in report.pulls:
                    update.pulls[rid] = report.pulls[rid]
        for rid, reason in report.failed.items():
            if self._handoffs.pop(rid, None) is not None:
                update.failed.append(RemoteKVFailure(rid, reason, self.failure_policy))
        for rid in report.aborted:
            if self._handoffs.pop(rid, None) is not None:
                update.aborted.append(rid)
        return update
