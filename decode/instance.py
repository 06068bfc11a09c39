"""The decode instance kind: takes handed-off requests, pulls their KV, decodes them.

Per request (a `KVHandoff` from a prefill instance, on this instance's task socket):

1. `DecodeKVScheduler.admit` checks the handoff before anything is allocated (a KV
   layout that differs from this instance's ends the request with a one-line error)
   and starts the lease heartbeats; the request joins the step scheduler with
   `add_remote_request`, P's first token already in its output;
2. when the step scheduler allocates its blocks (`SchedulerOutput.
   remote_kv_allocations`, which a step may carry while computing nothing), it is in
   WAITING_FOR_REMOTE_KVS and `on_allocation` pulls only the blocks the local prefix
   cache lacks;
3. every loop turn the connector's metadata goes to the worker and the worker's report
   comes back: `ready` → `finish_remote_kvs(success=True)` and the request decodes in
   the continuous batch from output index 1; `failed` → the failure policy
   (`recompute`: prefill here; `fail`: the request ends with the reason); `aborted`
   → its quarantined blocks are freed;
4. tokens stream to the gateway per step with their output indices.

An abort from the gateway ends the request here; if its handoff has not arrived yet,
the abort names the prefill instance, and that late handoff is dropped on arrival.
"""

from __future__ import annotations

import logging

import msgspec

from pdserve.decode.messages import DecodeTask, KVHandoff
from pdserve.decode.pending import DelayedPulls, VoidedHandoffs, injected_delay_s
from pdserve.instance.kv_instance import KVInstanceRuntime
from pdserve.instance.loop import error_delta
from pdserve.kvtransfer import DecodeKVScheduler
from pdserve.scheduler.messages import AbortTask, RequestDelta
from pdserve.scheduler.request import RequestStatus

logger = logging.getLogger(__name__)


class DecodeRuntime(KVInstanceRuntime):
    role = "decode"
    task_type = DecodeTask

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.kv: DecodeKVScheduler | None = None
        self.pulls = DelayedPulls(injected_delay_s())
        self.voided = VoidedHandoffs()
        self._pulling: dict[str, int] = {}  # request id → blocks its pull moves
        self._blocks_pulled = 0  # since the last output
        self._recomputed = 0
        self.blocks_pulled_total = 0

    def start_transfers(self) -> None:
        assert self.layout is not None
        self.kv = DecodeKVScheduler(self.layout, 1, self.kv_config.failure_policy)

    def require_kv(self) -> DecodeKVScheduler:
        if self.kv is None:
            raise RuntimeError("the instance is not loaded yet: call load() first")
        return self.kv

    # ---- tasks ------------------------------------------------------------------------

    def on_task(self, task) -> RequestDelta | None:
        if isinstance(task, KVHandoff):
            return self.admit(task)
        return super().on_task(task)

    def id_in_use(self, request_id: str) -> bool:
        return super().id_in_use(request_id) or self.require_kv().handoff(request_id) is not None

    def admit(self, handoff: KVHandoff) -> RequestDelta | None:
        request_id = handoff.request_id
        if self.voided.consume(request_id, handoff.source.instance_id):
            return None  # aborted before it arrived; P heard of the abort as well
        if self.id_in_use(request_id):
            self.defer(handoff)  # an earlier attempt is still pulling into its blocks
            return None
        kv = self.require_kv()
        try:
            num_remote_tokens = kv.admit(handoff)
        except ValueError as exc:
            return self._reject(handoff, f"cannot take over the request: {exc}")
        engine = self._require_engine()
        params = handoff.sampling_params
        if params.seed != handoff.seed:
            params = msgspec.structs.replace(params, seed=handoff.seed)
        try:
            request = engine.make_request(
                request_id, handoff.prompt_token_ids, params, handoff.cache_salt
            )
            request.output_token_ids.append(handoff.first_token_id)
            engine.scheduler.add_remote_request(request, num_remote_tokens)
        except ValueError as exc:
            kv.abort(request_id)  # tells P to let go of its blocks
            return self._reject(handoff, str(exc))
        return None

    def _reject(self, handoff: KVHandoff, message: str) -> RequestDelta:
        logger.warning("%s: %s", self.spec.instance_id, message)
        return error_delta(handoff.request_id, message, handoff.num_prompt_tokens, 1)

    def retry_deferred(self, task: KVHandoff) -> None:
        delta = self.admit(task)
        if delta is not None:
            self.emit(delta)

    def on_abort(self, task: AbortTask) -> None:
        super().on_abort(task)  # a pulling request's blocks stay quarantined
        kv = self.require_kv()
        for request_id in task.request_ids:
            kv.abort(request_id)
            self.pulls.drop(request_id)
            self.drop_deferred(request_id)
            if task.handoffs_from:
                self.voided.add(request_id, task.handoffs_from)

    # ---- the loop ---------------------------------------------------------------------

    def has_work(self) -> bool:
        scheduler = self._require_engine().scheduler
        return bool(scheduler.running or scheduler.waiting)

    def transfers_open(self) -> bool:
        return super().transfers_open() or len(self.pulls) > 0

    def step_engine(self) -> list[RequestDelta]:
        engine = self._require_engine()
        output = engine.scheduler.schedule()
        for allocation in output.remote_kv_allocations:
            self.pulls.add(allocation)
        self._start_due_pulls()
        return engine.execute(output)

    def before_step(self) -> None:
        self.retry_deferred_tasks()
        self._start_due_pulls()
        self._settle(self.require_kv().update(self.require_worker().get_finished()))

    def _start_due_pulls(self) -> None:
        scheduler = self._require_engine().scheduler
        kv = self.require_kv()
        for allocation in self.pulls.pop_due():
            request_id = allocation.request_id
            if request_id not in scheduler.waiting_for_remote:
                continue  # aborted meanwhile; the worker's abort report frees the blocks
            count = kv.on_allocation(allocation)
            if count is None:  # the connector already gave up on it
                self._fail_pull(request_id, "its KV transfer ended before the pull began")
            else:
                self._pulling[request_id] = count

    def _settle(self, update) -> None:
        scheduler = self._require_engine().scheduler
        for request_id in update.ready:
            scheduler.finish_remote_kvs(request_id, success=True)
            self._blocks_pulled += self._pulling.pop(request_id, 0)
            self.mark_news()
        for failure in update.failed:
            self._pulling.pop(failure.request_id, None)
            self._fail_pull(failure.request_id, failure.reason, failure.policy)
        for request_id in update.aborted:
            self._pulling.pop(request_id, None)
            scheduler.finish_remote_kvs(request_id, success=False)  # frees quarantined blocks

    def _fail_pull(self, request_id: str, reason: str, policy: str | None = None) -> None:
        policy = policy or self.kv_config.failure_policy
        scheduler = self._require_engine().scheduler
        request = scheduler.get_request(request_id)
        message = f"KV transfer failed: {reason}"
        if not scheduler.finish_remote_kvs(request_id, False, policy, message):
            return
        self.mark_news()
        logger.warning(
            "%s: request %s: %s (%s)", self.spec.instance_id, request_id, message, policy
        )
        if request is not None and request.status is RequestStatus.FINISHED_ERROR:
            self.emit(
                error_delta(
                    request_id, message, request.num_prompt_tokens, request.num_output_tokens
                )
            )
        else:
            self._recomputed += 1

    def after_step(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        self.require_worker().apply(self.require_kv().build_metadata())
        return deltas + self.take_pending_deltas()

    def kind_counters(self) -> dict[str, float]:
        counters = {
            "kv_transfer_blocks_total": float(self._blocks_pulled),
            "kv_transfer_recomputed_requests_total": float(self._recomputed),
        }
        self.blocks_pulled_total += self._blocks_pulled
        self._blocks_pulled = self._recomputed = 0
        return counters
