"""The global scheduler's bookkeeping: admission, routes, block events, deaths, retries."""

from __future__ import annotations

import pytest

from pdserve.common.block_events import BlockCacheSnapshot, BlockEventBatch, BlockStored
from pdserve.common.messages import InstanceInfo, InstanceStats
from pdserve.gateway.global_scheduler import (
    AdmissionRejected,
    GlobalScheduler,
    GlobalSchedulerConfig,
)
from pdserve.gateway.routing import RouteRequest
from pdserve.scheduler.block_hash import hash_full_blocks
from tests.gateway.instances import BLOCK, instance_info


def info(instance_id: str, role: str, max_num_seqs: int = 2, blocks: int = 50) -> InstanceInfo:
    return instance_info(instance_id, role, blocks, max_num_seqs)


def scheduler(*infos: InstanceInfo, **config) -> GlobalScheduler:
    gs = GlobalScheduler(GlobalSchedulerConfig(**config))
    for i in infos:
        gs.add_instance(i, now=0.0)
    return gs


def send(gs: GlobalScheduler, rid: str, tokens: int = 8):
    request = RouteRequest(rid, list(range(1, tokens + 1)))
    route = gs.route(request)
    gs.assign(request, route)
    return route


def test_admission_bounds_requests_beyond_the_running_seats() -> None:
    gs = scheduler(info("c0", "colocated"), info("c1", "colocated"), max_queued_requests=1)
    for i in range(5):  # 2 + 2 seats, 1 queued
        gs.admit()
        send(gs, str(i))
    with pytest.raises(AdmissionRejected) as rejected:
        gs.admit()
    assert rejected.value.retry_after_s == 1
    assert "capacity" in str(rejected.value)
    gs.finish("0")
    gs.admit()  # room again
    with pytest.raises(AdmissionRejected):
        gs.admit(2)  # a request with n=2 needs both seats at once


def test_no_live_instance_is_rejected() -> None:
    gs = scheduler()
    with pytest.raises(AdmissionRejected, match="no instance"):
        gs.admit()
    gs = scheduler(info("c0", "colocated"))
    gs.mark_dead("c0")
    with pytest.raises(AdmissionRejected):
        gs.admit()


def test_colocated_route_is_one_instance() -> None:
    gs = scheduler(info("c0", "colocated"), info("c1", "colocated"), routing_policy="round_robin")
    routes = [send(gs, str(i)) for i in range(3)]
    assert [r.prefill for r in routes] == [None, None, None]
    assert [r.decode.instance_id for r in routes] == ["c0", "c1", "c0"]
    assert gs.views["c0"].in_flight == {"0", "2"}


def test_disaggregated_route_pairs_prefill_and_decode() -> None:
    gs = scheduler(info("p0", "prefill"), info("d0", "decode"), info("d1", "decode"))
    route = send(gs, "r", tokens=10)
    assert route.prefill is not None and route.prefill.instance_id == "p0"
    assert route.first is route.prefill
    assert gs.views["p0"].unstarted_tokens == {"r": 10}
    assert "r" in gs.views[route.decode.instance_id].in_flight
    gs.mark_started("r")
    assert gs.views["p0"].unstarted_tokens == {}
    gs.finish("r")
    assert all(not v.in_flight for v in gs.views.values())


def test_short_prompts_skip_the_prefill_pool_when_asked() -> None:
    gs = scheduler(info("p0", "prefill"), info("d0", "decode"), skip_prefill_max_tokens=8)
    assert send(gs, "short", tokens=8).prefill is None
    assert send(gs, "long", tokens=9).prefill is not None


def test_stats_reset_the_pending_block_estimate_and_heartbeats_keep_alive() -> None:
    gs = scheduler(info("c0", "colocated"), instance_timeout_s=2.0)
    send(gs, "a", tokens=8)
    assert gs.views["c0"].pending_blocks == 2
    assert gs.observe("c0", InstanceStats(num_free_blocks=40, num_total_blocks=50), now=1.5)
    assert gs.views["c0"].pending_blocks == 0
    assert gs.views["c0"].estimated_free_blocks() == 40
    assert gs.find_silent(now=3.0) == []
    assert gs.observe("c0", None, now=3.0)  # a heartbeat without stats
    assert gs.find_silent(now=5.1) == ["c0"]
    assert not gs.observe("ghost", None, now=1.0)


def test_death_sends_started_and_unstarted_requests_again() -> None:
    gs = scheduler(
        info("p0", "prefill"), info("p1", "prefill"), info("d0", "decode", max_num_seqs=8),
        routing_policy="round_robin",
    )  # fmt: skip
    send(gs, "early")  # p0
    send(gs, "other")  # p1
    send(gs, "late")  # p0
    gs.mark_started("late")  # its first token is out: the gateway migrates it
    failover = gs.mark_dead("p0")
    assert failover.retry == ["early", "late"] and failover.fail == []
    # d0 also voids handoffs of these requests still on their way from p0.
    assert failover.abort == {("d0", "p0"): ["early", "late"]}
    assert "late" in gs.assignments and "early" in gs.assignments
    route = gs.route(gs.assignments["early"].request)
    assert route.prefill.instance_id == "p1"  # the dead one is never picked again
    gs.assign(gs.assignments["early"].request, route)
    assert gs.assignments["early"].attempts == 2
    # A migrated request runs whole on one instance: its output so far is computed there.
    migrated = gs.route(gs.assignments["late"].request, with_prefill=False)
    assert migrated.prefill is None and migrated.decode.instance_id == "d0"
    assert gs.mark_dead("p0").retry == []  # idempotent


def test_retries_stop_after_max_attempts() -> None:
    gs = scheduler(
        info("c0", "colocated"), info("c1", "colocated"), info("c2", "colocated"),
        routing_policy="round_robin", max_attempts=2,
    )  # fmt: skip
    send(gs, "r")  # c0
    assert gs.mark_dead("c0").retry == ["r"]
    request = gs.assignments["r"].request
    gs.assign(request, gs.route(request))  # c1 (round robin over c1, c2)
    dead = gs.assignments["r"].route.decode.instance_id
    failover = gs.mark_dead(dead)
    assert failover.fail == ["r"] and failover.retry == []


def test_block_events_gap_then_snapshot_with_buffered_replay() -> None:
    gs = scheduler(info("c0", "colocated"))
    a, b, c = (hash_full_blocks([i] * BLOCK, BLOCK) for i in (1, 2, 3))
    assert gs.apply_block_events("c0", BlockEventBatch(1, [BlockStored(a, None, BLOCK)]))
    # Batch 2 is lost: 3 opens a gap and is kept for later.
    assert not gs.apply_block_events("c0", BlockEventBatch(3, [BlockStored(c, None, BLOCK)]))
    snapshot = BlockCacheSnapshot(2, a + b)  # the instance's cache as of batch 2
    assert gs.apply_snapshot("c0", snapshot)
    assert gs.views["c0"].mirror.hashes == set(a + b + c)
    assert gs.views["c0"].mirror.seq == 3


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        GlobalSchedulerConfig(routing_policy="nope")
    with pytest.raises(ValueError, match="max_queued_requests"):
        GlobalSchedulerConfig(max_queued_requests=-1)
