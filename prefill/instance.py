"""The prefill instance kind: computes prompts, samples each first token, hands off.

Per request (`GenerateTask` with `decode_target`, the decode instance the global
scheduler matched it with):

1. it is queued with `hand_off=True`: chunked prefill under the token budget, then the
   first token is sampled and the step scheduler parks it in HANDED_OFF with its
   blocks held (a first token that already ends the request ends it here instead,
   and nothing is handed off);
2. that step's first tokens go to the gateway at once, before anything else (TTFT);
3. `PrefillKVScheduler.hand_off` builds the `KVHandoff` and a hold; the hold is
   applied to the KV transfer worker *before* the handoff leaves for the decode
   instance, so a pull never finds its blocks unannounced;
4. the worker serves the decode side's pull; its report says the request was
   `released` (D has the KV), `expired` (the lease ran out: D died or went silent) or
   `aborted`; each of them → `release_held_blocks`, and the prompt's full blocks stay
   in the prefix cache.

An abort from the gateway ends the request wherever it is; a held one has its hold
aborted (blocks quarantined until no send reads them). A retry of a request whose
earlier attempt still holds blocks here waits for them (see engine/kv_instance.py).
"""

from __future__ import annotations

import logging

from pdserve.instance.kv_instance import KVInstanceRuntime
from pdserve.instance.loop import error_delta
from pdserve.kvtransfer import PrefillKVScheduler
from pdserve.scheduler.messages import AbortTask, GenerateTask, InstanceAddress, RequestDelta

logger = logging.getLogger(__name__)


class PrefillRuntime(KVInstanceRuntime):
    role = "prefill"

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.kv: PrefillKVScheduler | None = None
        # Requests still to hand off once their first token is out, and to whom.
        self._targets: dict[str, InstanceAddress] = {}
        self.handoffs_sent = 0

    def start_transfers(self) -> None:
        worker = self.require_worker()
        assert self.layout is not None
        self.kv = PrefillKVScheduler(self.spec.instance_id, self.layout, [worker.control_address])

    def require_kv(self) -> PrefillKVScheduler:
        if self.kv is None:
            raise RuntimeError("the instance is not loaded yet: call load() first")
        return self.kv

    # ---- tasks ------------------------------------------------------------------------

    def on_generate(self, task: GenerateTask) -> None:
        if self.id_in_use(task.request_id):
            self.defer(task)  # an earlier attempt's blocks are still on loan
            return
        engine = self._require_engine()
        request = self.make_request(task)
        if task.decode_target is None:
            engine.add_request(request)  # no decode instance: it runs here to the end
            return
        engine.scheduler.add_request(request, hand_off=True)
        self._targets[task.request_id] = task.decode_target

    def retry_deferred(self, task: GenerateTask) -> None:
        try:
            self.on_generate(task)
        except ValueError as exc:
            self.emit(error_delta(task.request_id, str(exc), len(task.prompt_token_ids)))

    def on_abort(self, task: AbortTask) -> None:
        super().on_abort(task)
        kv = self.require_kv()
        for request_id in task.request_ids:
            kv.abort(request_id)  # a held request: its hold ends once no send reads it
            self._targets.pop(request_id, None)
            self.drop_deferred(request_id)

    # ---- the loop ---------------------------------------------------------------------

    def before_step(self) -> None:
        self.retry_deferred_tasks()
        update = self.require_kv().update(self.require_worker().get_finished())
        scheduler = self._require_engine().scheduler
        for request_id in (*update.released, *update.expired, *update.aborted):
            scheduler.release_held_blocks(request_id)
            self.mark_news()
        for request_id in update.expired:
            logger.warning(
                "%s: lease of %s ran out before the decode side took its KV; blocks freed",
                self.spec.instance_id,
                request_id,
            )

    def after_step(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        deltas = deltas + self.take_pending_deltas()
        ready = self._ready_to_hand_off(deltas)
        if ready:
            self._send(deltas)  # first tokens out before anything else: this is TTFT
            deltas = []
            self._hand_off(ready)
        self.require_worker().apply(self.require_kv().build_metadata())
        return deltas

    def _ready_to_hand_off(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """First-token deltas of requests now HANDED_OFF (blocks held for D)."""
        held = self._require_engine().scheduler.held
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
        scheduler = self._require_engine().scheduler
        kv = self.require_kv()
        messages = []
        for delta in ready:
            request_id = delta.request_id
            request = scheduler.held[request_id]
            logprob, top = None, None
            if delta.logprobs:
                first = delta.logprobs[0]
                logprob = first.logprob
                top = dict(zip(first.top_ids, first.top_logprobs, strict=True))
            handoff = kv.hand_off(
                request,
                scheduler.get_block_ids(request_id),
                request.output_token_ids[0],
                logprob,
                top,
            )
            messages.append((self._targets.pop(request_id), handoff))
        # The holds reach the worker before any handoff leaves (README: wiring).
        self.require_worker().apply(kv.build_metadata())
        for target, handoff in messages:
            self.send_to_instance(target, handoff)
        self.handoffs_sent += len(messages)
