"""The step scheduler's invariants, for tests and debugging: every request sits in
exactly the queue its status names, only requests that may hold blocks hold them, and
the block manager's own books balance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.common.request import RequestStatus

if TYPE_CHECKING:
    from pdserve.scheduler.step_scheduler import Scheduler

_STATUSES = {
    "waiting": {RequestStatus.WAITING, RequestStatus.PREEMPTED},
    "running": {RequestStatus.RUNNING},
    "waiting_for_remote": {RequestStatus.WAITING_FOR_REMOTE_KVS},
    "held": {RequestStatus.HANDED_OFF},
}


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    """Raises AssertionError naming the first broken invariant."""
    scheduler.block_manager.check_invariants()
    holders = scheduler.block_manager.holder_ids()
    groups = {
        "waiting": list(scheduler.waiting),
        "running": scheduler.running,
        "waiting_for_remote": list(scheduler.waiting_for_remote.values()),
        "held": list(scheduler.held.values()),
    }
    placed: dict[str, str] = {}
    for name, group in groups.items():
        for request in group:
            rid = request.request_id
            _check(rid not in placed, f"request {rid} is both {placed.get(rid)} and {name}")
            placed[rid] = name
            _check(scheduler.requests.get(rid) is request, f"{name} request {rid} is untracked")
            _check(
                request.status in _STATUSES[name],
                f"{name} request {rid} has status {request.status.name}",
            )
            _check(
                (rid in holders) == (name != "waiting"),
                f"{name} request {rid} {'holds' if rid in holders else 'lacks'} blocks",
            )
    _check(set(placed) == set(scheduler.requests), "tracked requests outside every queue")
    for rid, request in scheduler.quarantined.items():
        _check(request.status.finished, f"quarantined request {rid} is not finished")
        _check(rid in holders and rid not in placed, f"quarantined request {rid} misplaced")
    strays = holders - set(placed) - set(scheduler.quarantined)
    _check(not strays, f"blocks held by requests the scheduler does not know: {sorted(strays)}")
    block_size = scheduler.config.block_size
    for request in scheduler.running:
        room = len(scheduler.get_block_ids(request.request_id)) * block_size
        _check(
            request.num_computed_tokens <= room,
            f"running request {request.request_id} computed {request.num_computed_tokens} "
            f"tokens but holds room for {room}",
        )
    seated = len(scheduler.running) + len(scheduler.waiting_for_remote)
    _check(
        seated <= scheduler.config.max_num_seqs,
        f"{seated} requests seated, max_num_seqs is {scheduler.config.max_num_seqs}",
    )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
