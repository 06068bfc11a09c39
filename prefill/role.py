"""The prefill role: computes prompts, samples each first token, hands off and holds.

Per request (`GenerateTask` with `decode_target`, the decode instance the global
scheduler matched it with):

1. it is queued with `hand_off=True`: chunked prefill under the token budget, then the
   first token is sampled and the step scheduler parks it in HANDED_OFF with its
   blocks held (a first token that already ends the request ends it here instead,
   and nothing is handed off);
2. that step's first tokens go to the gateway at once, before anything else (TTFT);
3. `PrefillKVScheduler.hand_off` builds the `KVHandoff` and a hold; the hold reaches
   the ranks' transfer workers *before* the handoff leaves for the decode instance, so
   a pull never finds its blocks unannounced;
4. the ranks serve the decode side's pull; their reports say the request was
   `released` (D has the KV), `expired` (the lease ran out: D died or went silent) or
   `aborted`; each of them → `release_held_blocks`, and the prompt's full blocks stay
   in the prefix cache.

An abort from the gateway ends the request wherever it is; a held one has its hold
aborted (blocks quarantined until no send reads them). A retry of a request whose
earlier attempt still holds blocks here waits for them (`KVLink.defer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from pdserve.common.messages import (
    AbortTask,
    GenerateTask,
    InstanceAddress,
    InstanceStats,
    MetricsDelta,
    RequestDelta,
)
from pdserve.engine.core import EngineCore
from pdserve.kvtransfer import TransferReport
from pdserve.kvtransfer.link import KVLink
from pdserve.prefill.kv_scheduler import PrefillKVScheduler

logger = logging.getLogger(__name__)

SendToInstance = Callable[[InstanceAddress, msgspec.Struct], None]


class PrefillRole:
    def __init__(
        self,
        instance_id: str,
        engine: EngineCore,
        link: KVLink,
        send_to_instance: SendToInstance,
        flush: Callable[[list[RequestDelta]], None],
        epoch: int = 0,
    ) -> None:
        """`send_to_instance`: a message to another instance's task socket (the handoff);
        `flush(deltas)`: an output to the gateway now (first tokens before handoffs);
        `epoch`: this instance's, carried by every handoff."""
        self.instance_id = instance_id
        self.engine = engine
        self.link = link
        self.kv = PrefillKVScheduler(instance_id, link.layout, link.rank_addresses, epoch)
        self._send_to_instance = send_to_instance
        self._flush = flush
        # Requests still to hand off once their first token is out, and to whom (the
        # decode instance and its epoch, which the hold names).
        self._targets: dict[str, tuple[InstanceAddress, int]] = {}
        self.handoffs_sent = 0

    # ---- tasks ------------------------------------------------------------------------

    def admit(self, task: GenerateTask, received_at: float | None = None) -> None:
        if self.id_in_use(task.request_id):
            self.link.defer(task)  # an earlier attempt's blocks are still on loan
            return
        if task.output_token_ids and task.decode_target is not None:
            # A handoff carries one first token; a migrated request runs where it lands.
            raise ValueError("a request with output so far is never handed off")
        request = self.engine.request_of(task, received_at)
        if task.decode_target is None:
            self.engine.add_request(request)  # no decode instance: it runs here to the end
            return
        self.engine.add_request(request, hand_off=True)
        self._targets[task.request_id] = (task.decode_target, task.decode_epoch)

    def on_task(self, task: Any, received_at: float | None = None) -> RequestDelta | None:
        raise TypeError(f"a prefill instance has no {type(task).__name__} tasks")  # never decoded

    def request_ids(self) -> set[str]:
        return self.engine.request_ids() | self.link.deferred_ids() | set(self._targets)

    def abort(self, task: AbortTask) -> None:
        for request_id in task.request_ids:
            self.engine.abort_request(request_id)
            self.kv.abort(request_id)  # a held request: its hold ends once no send reads it
            self._targets.pop(request_id, None)
            self.link.drop_deferred(request_id)

    def id_in_use(self, request_id: str) -> bool:
        return self.engine.holds(request_id) or request_id in self.engine.scheduler.quarantined

    # ---- the loop ---------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def task_wait_s(self, idle_wait_s: float) -> float:
        compiling = len(self.engine.grammar_gate) > 0
        return self.link.task_wait_s(self.engine.scheduler, idle_wait_s, compiling)

    def before_step(self) -> None:
        self.link.admit_deferred(self.id_in_use, self.admit)
        self._settle(self.link.exchange(self.kv.build_metadata()))

    def step(self) -> list[RequestDelta]:
        return self.engine.step()

    def after_step(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        deltas = deltas + self.link.take_pending_deltas()
        ready = self._ready_to_hand_off(deltas)
        if ready:
            self._flush(deltas)  # first tokens out before anything else: this is TTFT
            deltas = []
            self._hand_off(ready)
        return deltas

    def has_news(self) -> bool:
        return self.link.has_news()

    def add_metrics(self, metrics: MetricsDelta) -> None:
        self.link.add_metrics(metrics, {})

    def add_stats(self, stats: InstanceStats) -> None:
        self.link.add_stats(stats)

    # ---- handoffs ---------------------------------------------------------------------

    def _settle(self, report: TransferReport) -> None:
        update = self.kv.update(report)
        scheduler = self.engine.scheduler
        for request_id in (*update.released, *update.expired, *update.aborted):
            scheduler.release_held_blocks(request_id)
            self.link.mark_news()
        for request_id in update.expired:
            logger.warning(
                "%s: lease of %s ran out before the decode side took its KV; blocks freed",
                self.instance_id,
                request_id,
            )

    def _ready_to_hand_off(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """First-token deltas of requests now HANDED_OFF (blocks held for D)."""
        held = self.engine.scheduler.held
        ready = []
        for delta in deltas:
            if delta.request_id not in self._targets:
                continue
            if delta.finished:
                del self._targets[delta.request_id]  # ended by its first token (or failed)
            elif delta.new_token_ids and delta.request_id in held:
                ready.append(delta)
        return ready

    def _hand_off(self, ready: list[RequestDelta]) -> None:
        scheduler = self.engine.scheduler
        messages = []
        for delta in ready:
            request = scheduler.held[delta.request_id]
            logprob, top = None, None
            if delta.logprobs:
                first = delta.logprobs[0]
                logprob = first.logprob
                top = dict(zip(first.top_ids, first.top_logprobs, strict=True))
            target, decode_epoch = self._targets.pop(delta.request_id)
            handoff = self.kv.hand_off(
                request,
                scheduler.get_block_ids(delta.request_id),
                request.output_token_ids[0],
                logprob,
                top,
                decode_id=target.instance_id,
                decode_epoch=decode_epoch,
            )
            messages.append((target, handoff))
        # The holds reach the ranks before any handoff leaves (kvtransfer/README.md).
        self._settle(self.link.exchange(self.kv.build_metadata()))
        for target, handoff in messages:
            self._send_to_instance(target, handoff)
        self.handoffs_sent += len(messages)
