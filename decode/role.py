"""The decode role: takes handed-off requests, pulls their KV, decodes them.

Per request (a `KVHandoff` from a prefill instance, on this instance's task socket):

1. `DecodeKVScheduler.admit` checks the handoff before anything is allocated (a KV
   layout that differs from this instance's ends the request with a one-line error)
   and starts the lease heartbeats; the request joins the step scheduler with
   `add_remote_request`, P's first token already in its output;
2. when the step scheduler allocates its blocks (`SchedulerOutput.
   remote_kv_allocations`, which a step may carry while computing nothing), it is in
   WAITING_FOR_REMOTE_KVS and `on_allocation` pulls only the blocks the local prefix
   cache lacks; the pull goes to the ranks with that step's connector metadata;
3. the ranks' reports come back with every executor call: `ready` →
   `finish_remote_kvs(success=True)` and the request decodes in the continuous batch
   from output index 1; `failed` → the failure policy (`recompute`: prefill here;
   `fail`: the request ends with the reason); `aborted` → its quarantined blocks are
   freed;
4. tokens stream to the gateway per step with their output indices.

An abort from the gateway ends the request here; if its handoff has not arrived yet,
the abort names the prefill instance, and that late handoff is dropped on arrival. A
handoff routed to another epoch of this instance, or from a retired epoch of its prefill
instance, is dropped too (`stale_epoch`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import msgspec

from pdserve.common.frame_drops import DROPS, STALE_EPOCH
from pdserve.common.frame_seal import TASKS
from pdserve.common.messages import (
    AbortTask,
    GenerateTask,
    InstanceStats,
    MetricsDelta,
    RequestDelta,
    Task,
    error_delta,
)
from pdserve.common.request import RequestStatus
from pdserve.decode.kv_scheduler import DecodeKVScheduler, DecodeUpdate
from pdserve.decode.pending import SourceEpochs, VoidedHandoffs
from pdserve.decode.pull_outcomes import PullOutcomes
from pdserve.engine.core import EngineCore
from pdserve.kvtransfer.link import KVLink
from pdserve.kvtransfer.messages import KVHandoff
from pdserve.scheduler.outputs import RemoteKVAllocation

logger = logging.getLogger(__name__)


class PullQueue(Protocol):
    """Holds allocations back before their pull starts (a test hook delays pulls)."""

    def add(self, allocation: RemoteKVAllocation) -> None: ...

    def pop_due(self) -> list[RemoteKVAllocation]: ...

    def drop(self, request_id: str) -> None: ...

    def __len__(self) -> int: ...


class DecodeRole:
    # The task socket takes the gateway's tasks and the prefill instances' handoffs.
    task_type: Any = Task | KVHandoff

    def __init__(
        self,
        instance_id: str,
        engine: EngineCore,
        link: KVLink,
        held_pulls: PullQueue | None = None,
        epoch: int = 0,
    ) -> None:
        """`held_pulls`: None starts each pull as soon as its blocks are allocated;
        `epoch`: this instance's, carried by its ranks' control messages."""
        self.instance_id = instance_id
        self.engine = engine
        self.link = link
        policy = link.config.failure_policy
        self.kv = DecodeKVScheduler(link.layout, link.tp_size, policy, epoch)
        self.held_pulls = held_pulls
        self.voided = VoidedHandoffs()
        self.source_epochs = SourceEpochs()
        self._pulling: dict[str, int] = {}  # request id → blocks its pull moves
        self._blocks_pulled = 0  # since the last output
        self._recomputed = 0
        self.pull_outcomes = PullOutcomes()
        self.blocks_pulled_total = 0

    # ---- tasks ------------------------------------------------------------------------

    def admit(self, task: GenerateTask, received_at: float | None = None) -> None:
        """A request sent here without a prefill instance: it is computed here from its
        prompt (the global scheduler's decode-side prefill of short prompts), or from its
        prompt and output so far (a request migrated off a dead instance)."""
        if self.id_in_use(task.request_id):
            # An earlier attempt (aborted: its prefill instance died) still pulls into
            # its blocks here.
            self.link.defer(task)
            return
        self.engine.add_request(self.engine.request_of(task, received_at))

    def on_task(self, task: Any, received_at: float | None = None) -> RequestDelta | None:
        if isinstance(task, KVHandoff):
            return self.take_handoff(task, received_at)
        logger.warning("%s: ignoring a %s task", self.instance_id, type(task).__name__)
        return None

    def id_in_use(self, request_id: str) -> bool:
        return (
            self.engine.holds(request_id)
            or request_id in self.engine.scheduler.quarantined
            or self.kv.handoff(request_id) is not None
        )

    def take_handoff(
        self, handoff: KVHandoff, received_at: float | None = None
    ) -> RequestDelta | None:
        """`received_at`: when it reached this instance (its queue and the handoff's
        transit meet there); None for a handoff deferred since."""
        request_id = handoff.request_id
        if handoff.decode_epoch != self.kv.epoch:  # routed to another life of this instance
            DROPS.count(TASKS.name, STALE_EPOCH)
            logger.warning(
                "%s: dropping a handoff of %s for epoch %d (epoch %d now)",
                self.instance_id,
                request_id,
                handoff.decode_epoch,
                self.kv.epoch,
            )
            return None
        if not self.source_epochs.admit(handoff.source.instance_id, handoff.source.epoch):
            return None  # from a prefill instance retired since: the gateway moved it on
        if self.voided.consume(request_id, handoff.source.instance_id):
            return None  # aborted before it arrived; P heard of the abort as well
        if self.id_in_use(request_id):
            self.link.defer(handoff)  # an earlier attempt is still pulling into its blocks
            return None
        try:
            num_remote_tokens = self.kv.admit(handoff)
        except ValueError as exc:
            return self._reject(handoff, f"cannot take over the request: {exc}")
        engine = self.engine
        try:
            request = engine.make_request(
                request_id,
                handoff.prompt_token_ids,
                handoff.sampling_params,
                handoff.cache_salt,
                received_at=received_at,
            )
            request.output_token_ids.append(handoff.first_token_id)
            engine.add_remote_request(request, num_remote_tokens)
        except ValueError as exc:
            self.kv.abort(request_id)  # tells P to let go of its blocks
            return self._reject(handoff, str(exc))
        return None

    def _admit_deferred(self, task: KVHandoff | GenerateTask) -> RequestDelta | None:
        if isinstance(task, KVHandoff):
            return self.take_handoff(task)
        self.admit(task)
        return None

    def _reject(self, handoff: KVHandoff, message: str) -> RequestDelta:
        logger.warning("%s: %s", self.instance_id, message)
        return error_delta(handoff.request_id, message, handoff.num_prompt_tokens, 1)

    def request_ids(self) -> set[str]:
        return self.engine.request_ids() | self.link.deferred_ids()

    def abort(self, task: AbortTask) -> None:
        for request_id in task.request_ids:
            self.engine.abort_request(request_id)  # a pulling request's blocks stay quarantined
            self.kv.abort(request_id)
            if self.held_pulls is not None:
                self.held_pulls.drop(request_id)
            self.link.drop_deferred(request_id)
            if task.handoffs_from:
                self.voided.add(request_id, task.handoffs_from)

    # ---- the loop ---------------------------------------------------------------------

    def has_work(self) -> bool:
        scheduler = self.engine.scheduler
        return bool(scheduler.running or scheduler.waiting or len(self.engine.grammar_gate))

    def task_wait_s(self, idle_wait_s: float) -> float:
        busy = self.held_pulls is not None and len(self.held_pulls) > 0
        busy = busy or len(self.engine.grammar_gate) > 0  # polled each turn
        return self.link.task_wait_s(self.engine.scheduler, idle_wait_s, busy)

    def before_step(self) -> None:
        self.link.admit_deferred(self.id_in_use, self._admit_deferred)
        if self.held_pulls is not None:
            self._start_pulls(self.held_pulls.pop_due())
        self._settle(self.link.exchange(self.kv.build_metadata()))

    def step(self) -> list[RequestDelta]:
        output = self.engine.schedule()
        if self.held_pulls is None:
            self._start_pulls(output.remote_kv_allocations)
        else:
            for allocation in output.remote_kv_allocations:
                self.held_pulls.add(allocation)
        # The new pulls reach the ranks with this step, before its model work.
        deltas, reports = self.engine.execute_with_kv(output, self.kv.build_metadata())
        self._settle(self.link.absorb(reports))
        return deltas

    def after_step(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        return deltas + self.link.take_pending_deltas()

    def has_news(self) -> bool:
        return self.link.has_news()

    def add_metrics(self, metrics: MetricsDelta) -> None:
        counters = {
            "kv_transfer_blocks_total": float(self._blocks_pulled),
            "kv_transfer_recomputed_requests_total": float(self._recomputed),
        }
        self.blocks_pulled_total += self._blocks_pulled
        self._blocks_pulled = self._recomputed = 0
        self.link.add_metrics(metrics, counters)

    def add_stats(self, stats: InstanceStats) -> None:
        self.link.add_stats(stats)
        self.pull_outcomes.add_stats(stats)

    # ---- pulls ------------------------------------------------------------------------

    def _start_pulls(self, allocations: list[RemoteKVAllocation]) -> None:
        waiting = self.engine.scheduler.waiting_for_remote
        for allocation in allocations:
            request_id = allocation.request_id
            if request_id not in waiting:
                continue  # aborted meanwhile; the ranks' abort report frees the blocks
            count = self.kv.on_allocation(allocation)
            if count is None:  # the connector already gave up on it
                self._fail_pull(request_id, "its KV transfer ended before the pull began")
            else:
                self._pulling[request_id] = count

    def _settle(self, update_report) -> None:
        update: DecodeUpdate = self.kv.update(update_report)
        scheduler = self.engine.scheduler
        for request_id in update.ready:
            blocks = self._pulling.pop(request_id, 0)
            request = scheduler.get_request(request_id)
            pull = update.pulls.get(request_id)
            if request is not None and pull is not None:
                request.kv_pull = msgspec.structs.replace(pull, num_blocks=blocks)
            scheduler.finish_remote_kvs(request_id, success=True)
            self._blocks_pulled += blocks
            self.pull_outcomes.pulled()
            self.link.mark_news()
        for failure in update.failed:
            self._pulling.pop(failure.request_id, None)
            self._fail_pull(failure.request_id, failure.reason, failure.policy)
        for request_id in update.aborted:
            self._pulling.pop(request_id, None)
            scheduler.finish_remote_kvs(request_id, success=False)  # frees quarantined blocks

    def _fail_pull(self, request_id: str, reason: str, policy: str | None = None) -> None:
        policy = policy or self.link.config.failure_policy
        scheduler = self.engine.scheduler
        request = scheduler.get_request(request_id)
        message = f"KV transfer failed: {reason}"
        if not scheduler.finish_remote_kvs(request_id, False, policy, message):
            return
        self.link.mark_news()
        logger.warning("%s: request %s: %s (%s)", self.instance_id, request_id, message, policy)
        ended = request is not None and request.status is RequestStatus.FINISHED_ERROR
        self.pull_outcomes.failed(reason, recomputed=not ended)
        if request is not None and ended:
            self.link.emit(
                error_delta(
                    request_id, message, request.num_prompt_tokens, request.num_output_tokens
                )
            )
        else:
            self._recomputed += 1
