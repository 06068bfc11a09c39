"""Decode side of the step scheduler: admitting a request whose KV is remote, and
ending the pull of that KV.

`Scheduler.add_remote_request` queues a handed-off request with a `RemoteKV` record;
its admission (`admit_remote`) allocates blocks and reports them
(`remote_kv_allocations`); `finish_remote_kvs` ends the pull, in success or failure,
under the failure policy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.request import Request, RequestStatus
from pdserve.scheduler.outputs import RemoteKVAllocation, SchedulerOutput

if TYPE_CHECKING:
    from pdserve.scheduler.step_scheduler import Scheduler

REMOTE_KV_POLICIES = ("recompute", "fail")


@dataclass
class RemoteKV:
    """Decode side: a queued or pulling request's KV that lives on a prefill instance."""

    num_remote_tokens: int
    num_local_cached_tokens: int = 0


def admit_remote(
    scheduler: Scheduler, request: Request, remote: RemoteKV, output: SchedulerOutput
) -> bool:
    """Allocates the blocks a queued remote request pulls its KV into (its locally
    cached prefix reused) and reports them; False if the blocks are short."""
    manager = scheduler.block_manager
    hit = manager.find_cached_prefix(request, remote.num_remote_tokens, must_compute_last=False)
    if not manager.allocate_slots(request, remote.num_remote_tokens, hit):
        return False
    scheduler.take_waiting(request)
    scheduler.mark_scheduled(request)
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    request.num_computed_tokens = request.num_cached_tokens = hit.num_tokens
    remote.num_local_cached_tokens = hit.num_tokens
    scheduler.waiting_for_remote[request.request_id] = request
    output.remote_kv_allocations.append(
        RemoteKVAllocation(
            request_id=request.request_id,
            block_ids=manager.get_block_ids(request.request_id),
            num_remote_tokens=remote.num_remote_tokens,
            num_local_cached_tokens=hit.num_tokens,
            block_size=scheduler.config.block_size,
        )
    )
    return True


def finish_remote_kvs(
    scheduler: Scheduler, request_id: str, success: bool, policy: str, error: str = ""
) -> bool:
    """The pull of a request's remote KV ended. On success it runs from the first
    output token; on failure it either prefills the missing part here
    ("recompute") or ends in FINISHED_ERROR ("fail"). Call it exactly once for
    every allocation in `remote_kv_allocations`, once no transfer can still write
    into the request's blocks — also for a request ended meanwhile, whose
    quarantined blocks it then frees (and returns False).

    A failure may also come while the request is still queued, before any block
    was allocated (e.g. the prefill instance refused the handshake): "recompute"
    turns it into an ordinary request that prefills here, "fail" ends it. False
    for an id that is neither pulling nor queued as remote."""
    if policy not in REMOTE_KV_POLICIES:
        raise ValueError(f"policy must be one of {REMOTE_KV_POLICIES}, got {policy!r}")
    if request_id in scheduler.remote_kv and request_id in scheduler.quarantined:  # ended meanwhile
        del scheduler.quarantined[request_id]
        del scheduler.remote_kv[request_id]
        scheduler.block_manager.free(request_id)
        return False
    queued = scheduler.requests.get(request_id)
    if (
        queued is not None
        and queued.status is RequestStatus.WAITING
        and request_id in scheduler.remote_kv
    ):
        return _fail_queued_remote(scheduler, queued, success, policy, error)
    request = scheduler.waiting_for_remote.get(request_id)
    if request is None:
        return False
    remote = scheduler.remote_kv.pop(request_id)
    del scheduler.waiting_for_remote[request_id]
    if not success and policy == "fail":
        _end_with_error(scheduler, request, error)
        scheduler.block_manager.free(request_id)
        return True
    if success:
        request.kv_ready_time = scheduler.clock()
        request.num_computed_tokens = remote.num_remote_tokens
        scheduler.block_manager.cache_full_blocks(request, remote.num_remote_tokens)
    else:
        request.num_computed_tokens = remote.num_local_cached_tokens
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return True


def _fail_queued_remote(
    scheduler: Scheduler, request: Request, success: bool, policy: str, error: str
) -> bool:
    rid = request.request_id
    if success:
        raise ValueError(f"request {rid}: no blocks were allocated, so no KV can have arrived")
    del scheduler.remote_kv[rid]
    if policy == "fail":
        scheduler.waiting = deque(r for r in scheduler.waiting if r is not request)
        _end_with_error(scheduler, request, error)
    # "recompute": it stays queued as an ordinary request (prompt + first token).
    return True


def _end_with_error(scheduler: Scheduler, request: Request, error: str) -> None:
    """A remote request whose KV never came, under the "fail" policy; the caller
    frees its blocks if it has any."""
    rid = request.request_id
    request.error = error or f"KV transfer for request {rid} failed"
    request.status = RequestStatus.FINISHED_ERROR
    del scheduler.requests[rid]
    scheduler.left_ids.append(rid)
