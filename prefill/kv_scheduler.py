"""The prefill role's half of the KV connector, on the instance's driver.

It decides, the ranks' transfer workers do. Each step the role collects
`build_metadata()`, which reaches every rank with the step's plan; the (aggregated)
`TransferReport` comes back through `update()`, which says what to do with each request.
It never calls the step scheduler: the role does, with what `update` returns.

`hand_off` turns a request whose first token is out into the handoff message and holds
its blocks; `update` says which held requests may release them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from pdserve.kvtransfer.layout import blocks_for, check_tp_split
from pdserve.kvtransfer.messages import (
    HoldSpec,
    KVConnectorMetadata,
    KVHandoff,
    KVLayout,
    KVSource,
    TransferReport,
)

if TYPE_CHECKING:
    from pdserve.common.request import Request


@dataclass
class PrefillUpdate:
    released: list[str] = field(default_factory=list)  # D has the KV: blocks → prefix cache
    expired: list[str] = field(default_factory=list)  # lease ran out: free the blocks
    aborted: list[str] = field(default_factory=list)  # aborted: free the blocks


class PrefillKVScheduler:
    def __init__(
        self, instance_id: str, layout: KVLayout, rank_addresses: list[str], epoch: int = 0
    ):
        self._pending = KVConnectorMetadata(epoch=epoch)  # for the ranks, until the next step
        tp_size = len(rank_addresses) // layout.pipeline_parallel_size
        check_tp_split(layout, tp_size, f"instance {instance_id}")
        self.instance_id = instance_id
        self.layout = layout
        self.rank_addresses = list(rank_addresses)
        self.epoch = epoch  # the instance's, in every handoff's source
        self._held: set[str] = set()
        self.lease_expiries = 0

    def build_metadata(self) -> KVConnectorMetadata:
        """The commands queued for the ranks' transfer workers since the last step."""
        metadata, self._pending = self._pending, KVConnectorMetadata(epoch=self.epoch)
        return metadata

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
        *,
        decode_id: str,
        decode_epoch: int,
    ) -> KVHandoff:
        """Hold the request's prompt blocks for decode instance `decode_id` in
        `decode_epoch` (only that life's control messages touch them) and build the
        handoff for it. Apply this step's metadata to the workers before sending the
        handoff on."""
        rid = request.request_id
        if rid in self._held:
            raise ValueError(f"request {rid} is already handed off")
        needed = blocks_for(len(request.prompt_token_ids), self.layout.block_size)
        if len(block_ids) < needed:
            raise ValueError(
                f"request {rid}: {len(block_ids)} blocks cannot hold "
                f"{len(request.prompt_token_ids)} prompt tokens"
            )
        prompt_blocks = list(block_ids[:needed])
        self._held.add(rid)
        self._pending.holds.append(HoldSpec(rid, prompt_blocks, decode_id, decode_epoch))
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
            source=KVSource(
                self.instance_id, self.rank_addresses, prompt_blocks, self.layout, self.epoch
            ),
            decode_epoch=decode_epoch,
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
