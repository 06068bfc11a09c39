"""One instance's step scheduler: which requests compute which tokens in the next step.

Each step serves the running requests first (a decode takes one token, a request in
chunked prefill as many as the budget leaves), then admits waiting requests first
come first served, until the token budget, `max_num_seqs` or the free blocks run out.
A running request that finds no free block preempts the most recently admitted one
(possibly itself): its blocks go back, and it is recomputed from the front of the
waiting queue later — prompt and output tokens alike, so nothing it generated is lost.

Disaggregation hooks:
- prefill side: a request added with `hand_off=True` stops after its first token and
  keeps its blocks (HANDED_OFF) until `release_held_blocks`;
- decode side: `add_remote_request` admits a request whose prompt KV lives on a
  prefill instance into WAITING_FOR_REMOTE_KVS with blocks allocated for it (reported
  in `SchedulerOutput.remote_kv_allocations`), and `finish_remote_kvs` lets it run.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from pdserve.common.block_events import BlockCacheSnapshot, BlockEventBatch
from pdserve.common.request import PhaseTimes, Request, RequestStatus
from pdserve.scheduler.admission import check_admissible, max_kv_tokens_of
from pdserve.scheduler.block_manager import BlockManager
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.outputs import (
    ScheduledChunk,
    SchedulerOutput,
    SchedulerStats,
)
from pdserve.scheduler.prefix_order import PrefixOrder
from pdserve.scheduler.remote_kv import RemoteKV, admit_remote, finish_remote_kvs
from pdserve.scheduler.scheduler_checks import check_scheduler_invariants
from pdserve.scheduler.stop_checker import check_stop

_TRANSFER_STATUSES = (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.HANDED_OFF)
# Phase times kept for `take_phase_times`: an instance takes them every output; the
# offline engine never does, so only the latest are kept.
PHASE_TIMES_KEPT = 4096


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.max_pending_block_events,
        )
        self.requests: dict[str, Request] = {}  # every request that is not finished here
        self.waiting: deque[Request] = deque()  # WAITING or PREEMPTED, admission order
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.waiting_for_remote: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # HANDED_OFF, blocks kept for the decode side
        # Ended while a transfer may still touch their blocks (pulling remote KV, or
        # handed off): blocks kept until the transfer's end is reported.
        self.quarantined: dict[str, Request] = {}
        self.remote_kv: dict[str, RemoteKV] = {}  # decode side, until the KV has arrived
        self._hand_off: set[str] = set()  # prefill side, until the first token
        self.left_ids: list[str] = []  # left the compute set since the last schedule()
        self.num_preemptions_total = 0
        self.clock = time.monotonic  # the requests' timestamps (tests substitute it)
        self.phase_times: deque[PhaseTimes] = deque(maxlen=PHASE_TIMES_KEPT)
        self.prefix_order = (
            PrefixOrder(self.block_manager) if config.scheduling_policy == "lpm" else None
        )

    # ---- requests in ---------------------------------------------------------------

    def add_request(self, request: Request, hand_off: bool = False) -> None:
        """Queues a request. With `hand_off` (prefill side) it stops after its first
        token and keeps its blocks for a decode instance, unless that token ends it."""
        max_kv_tokens = request.num_tokens if hand_off else max_kv_tokens_of(request, self.config)
        check_admissible(request, max_kv_tokens, self)
        if hand_off:
            self._hand_off.add(request.request_id)
        self._enqueue(request)

    def add_remote_request(self, request: Request, num_remote_tokens: int) -> None:
        """Decode side: queues a handed-off request whose first `num_remote_tokens`
        tokens have KV on a prefill instance; `request.output_token_ids` holds the
        first token sampled there."""
        if not request.output_token_ids:
            raise ValueError(
                f"request {request.request_id}: a remote request needs the first token "
                "sampled on the prefill instance in output_token_ids"
            )
        if not 1 <= num_remote_tokens < request.num_tokens:
            raise ValueError(
                f"request {request.request_id}: num_remote_tokens must be in "
                f"[1, {request.num_tokens - 1}], got {num_remote_tokens}"
            )
        check_admissible(request, max_kv_tokens_of(request, self.config), self)
        self.remote_kv[request.request_id] = RemoteKV(num_remote_tokens)
        request.prefilled_elsewhere = True
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.queued_time = self.clock()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # ---- requests out --------------------------------------------------------------

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """Ends a request wherever it is (the front end matched a stop string, the
        client went away, ...) and frees its blocks. False if it is not here.

        Blocks a transfer may still touch are not freed here but quarantined until
        the transfer's end is reported: `finish_remote_kvs` for a request pulling
        remote KV (a cancelled pull may still write into them), `release_held_blocks`
        for a handed-off one (the decode side may still be reading them)."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status.name}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        in_transfer = request.status in _TRANSFER_STATUSES
        if request.status is RequestStatus.HANDED_OFF:
            del self.held[request_id]  # reported when it was handed off
        else:
            self.phase_times.append(request.phase_times())
            self._drop_from_queues(request)
            self.left_ids.append(request_id)
        if in_transfer:
            self.quarantined[request_id] = request
        else:
            self.remote_kv.pop(request_id, None)
            self.block_manager.free(request_id)
        self._hand_off.discard(request_id)
        request.status = status
        return True

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _drop_from_queues(self, request: Request) -> None:
        status = request.status
        if status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting = deque(r for r in self.waiting if r is not request)
        elif status is RequestStatus.RUNNING:
            self.running = [r for r in self.running if r is not request]
        elif status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.waiting_for_remote[request.request_id]

    def release_held_blocks(self, request_id: str) -> bool:
        """Prefill side: the decode side has the KV, or the transfer was aborted, or
        its lease ran out; the blocks go to the prefix cache. Call it once for every
        handed-off request, even one ended meanwhile. False if nothing is held."""
        if request_id in self.held:
            del self.held[request_id]
            del self.requests[request_id]
        elif request_id in self.quarantined and request_id not in self.remote_kv:
            del self.quarantined[request_id]
        else:
            return False
        self.block_manager.free(request_id)
        return True

    # ---- the step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_ids=self.left_ids)
        self.left_ids = []
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if not output.preempted_ids:  # blocks are short: admitting more would thrash
            self._admit_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # Leave a token for each running request behind this one, so a long
            # prefill chunk never stalls their decodes.
            share = max(1, budget - (len(self.running) - i - 1))
            num_new = self._chunk_size(request.num_tokens - request.num_computed_tokens, share)
            if num_new == 0:
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_new, output):
                break  # it preempted itself, being the last running request
            self._add_chunk(output, request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _chunk_size(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        end = request.num_computed_tokens + num_new
        while not self.block_manager.allocate_slots(request, end):
            victim = self.running.pop()
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.preempted_times.append(self.clock())
        self.waiting.appendleft(request)
        output.preempted_ids.append(request.request_id)
        self.num_preemptions_total += 1

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        seats = max(0, self.config.max_num_seqs - self._num_seats_taken())
        if self.prefix_order is None:  # each try admits or ends the pass: `seats` at most
            self._admit_in_order(list(itertools.islice(self.waiting, seats)), output, budget)
        elif seats and self.waiting and (budget or self.remote_kv):  # else spare the lookups
            queued = list(self.waiting)
            self.prefix_order.begin(self.running)
            order = self.prefix_order.order(queued, self.remote_kv.keys())
            admitted = self._admit_in_order(order, output, budget)
            self.prefix_order.passed_over(queued, admitted)

    def _admit_in_order(
        self, order: list[Request], output: SchedulerOutput, budget: int
    ) -> set[str]:
        """Admits from `order` until the budget, the seats or the blocks run out; the ids
        of the requests admitted."""
        admitted: set[str] = set()
        for request in order:
            if self._num_seats_taken() >= self.config.max_num_seqs:
                break
            remote = self.remote_kv.get(request.request_id)
            if remote is not None:
                if not admit_remote(self, request, remote, output):
                    break
                admitted.add(request.request_id)
                continue
            if budget == 0:
                break
            hit = self.block_manager.find_cached_prefix(request, request.num_tokens)
            if self.prefix_order is not None and self.prefix_order.waits(request, hit):
                continue  # a running request is computing its next block
            num_new = self._chunk_size(request.num_tokens - hit.num_tokens, budget)
            if num_new == 0:
                break
            if not self.block_manager.allocate_slots(request, hit.num_tokens + num_new, hit):
                break
            self.take_waiting(request)
            admitted.add(request.request_id)
            if self.prefix_order is not None:
                self.prefix_order.admitted(request)
            self.mark_scheduled(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_cached_tokens = hit.num_tokens
            self.running.append(request)
            self._add_chunk(output, request, num_new)
            budget -= num_new
        return admitted

    def take_waiting(self, request: Request) -> None:
        """Takes `request` out of the waiting queue, to run or pull its KV."""
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)

    def mark_scheduled(self, request: Request) -> None:
        if request.first_scheduled_time is None:  # a preempted one keeps its first
            request.first_scheduled_time = self.clock()
        elif len(request.resumed_times) < len(request.preempted_times):
            request.resumed_times.append(self.clock())

    def _num_seats_taken(self) -> int:
        return len(self.running) + len(self.waiting_for_remote)

    def _add_chunk(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        block_ids = self.block_manager.get_block_ids(request.request_id)
        output.chunks.append(
            ScheduledChunk(request, request.num_computed_tokens, num_new, block_ids)
        )

    # ---- after the step ------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Applies a computed step: advances each chunk's request, caches the blocks
        it filled, appends the tokens sampled for chunks that sample, and checks stops.

        Returns the requests that left the compute set: finished ones (their blocks
        freed into the prefix cache) and, on the prefill side, HANDED_OFF ones.
        Chunks of requests that ended in between (an abort) are skipped.
        """
        left: list[Request] = []
        for chunk in output.chunks:
            request = chunk.request
            rid = request.request_id
            if request.status is not RequestStatus.RUNNING or self.requests.get(rid) is not request:
                continue
            if request.num_computed_tokens != chunk.start:
                raise ValueError(
                    f"request {rid}: chunk starts at {chunk.start} but "
                    f"{request.num_computed_tokens} tokens are computed (applied twice?)"
                )
            samples = chunk.samples  # judged before the new token lengthens the request
            request.num_computed_tokens = chunk.end
            self.block_manager.cache_full_blocks(request, chunk.end)
            if not samples:
                continue
            if rid not in sampled:
                raise ValueError(f"request {rid}: its chunk samples but no token came back")
            request.output_token_ids.append(sampled[rid])
            self._mark_token(request)
            status = check_stop(request, self.config.max_model_len)
            if status is not None:
                self._finish(request, status)
                left.append(request)
            elif rid in self._hand_off:
                self._hold(request)
                left.append(request)
        if left:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return left

    def _mark_token(self, request: Request) -> None:
        request.last_token_time = self.clock()
        if request.first_token_time is None:
            request.first_token_time = request.last_token_time

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a running request; the caller removes it from `running`."""
        rid = request.request_id
        self.phase_times.append(request.phase_times())
        request.status = status
        del self.requests[rid]
        self._hand_off.discard(rid)
        self.block_manager.free(rid)
        self.left_ids.append(rid)

    def _hold(self, request: Request) -> None:
        """Prefill side: the first token is out; keep the blocks for the decode side."""
        request.status = RequestStatus.HANDED_OFF
        self.phase_times.append(request.phase_times(handed_off=True))
        self._hand_off.discard(request.request_id)
        self.held[request.request_id] = request
        self.left_ids.append(request.request_id)

    # ---- decode side: remote KV ----------------------------------------------------

    def finish_remote_kvs(
        self, request_id: str, success: bool, policy: str = "recompute", error: str = ""
    ) -> bool:
        """The pull of a request's remote KV ended (see `remote_kv.finish_remote_kvs`)."""
        return finish_remote_kvs(self, request_id, success, policy, error)

    # ---- queries -------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """Whether any request still needs steps (held ones do not)."""
        return bool(self.waiting or self.running or self.waiting_for_remote)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_manager.get_block_ids(request_id)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_remote_kvs=len(self.waiting_for_remote),
            num_held=len(self.held),
            kv_cache_usage_perc=bm.usage(),
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=bm.prefix_cache_queries,
            prefix_cache_hits_total=bm.prefix_cache_hits,
        )

    def take_phase_times(self) -> list[PhaseTimes]:
        """The phase times of the requests that left since the last call."""
        taken = list(self.phase_times)
        self.phase_times.clear()
        return taken

    def drain_block_events(self) -> BlockEventBatch | None:
        return self.block_manager.drain_events()

    def block_cache_snapshot(self) -> BlockCacheSnapshot:
        return self.block_manager.snapshot()

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken invariant (tests call it)."""
        check_scheduler_invariants(self)
