"""The global scheduler's liveness books: silence and stalls, retired epochs (a dead
instance never returns in its epoch, only a replacement in a later one), and a prefill
instance's death sparing requests whose KV reached their decode instance."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.common.messages import InstanceStats
from pdserve.gateway.global_scheduler import GlobalScheduler, GlobalSchedulerConfig
from pdserve.gateway.routing import RouteRequest
from tests.gateway.instances import instance_info


def scheduler(*ids_roles: tuple[str, str], **config) -> GlobalScheduler:
    gs = GlobalScheduler(GlobalSchedulerConfig(**config))
    for instance_id, role in ids_roles:
        gs.add_instance(instance_info(instance_id, role), now=0.0)
    return gs


def send(gs: GlobalScheduler, rid: str) -> None:
    request = RouteRequest(rid, list(range(1, 9)))
    gs.assign(request, gs.route(request))


def test_a_long_step_is_no_stall_but_a_loop_that_never_turns_is() -> None:
    gs = scheduler(("c0", "colocated"), instance_timeout_s=2.0, instance_stall_timeout_s=30.0)
    for now in range(1, 30):  # heartbeats every second, the loop inside one long step
        assert gs.observe("c0", None, float(now), loop_turns=5)
        assert gs.find_silent(float(now)) == [] and gs.find_stalled(float(now)) == []
    assert gs.observe("c0", None, 31.0, loop_turns=6)  # the step ended: progress
    assert gs.observe("c0", None, 60.0, loop_turns=6)
    assert gs.find_stalled(60.0) == []
    assert gs.find_stalled(61.5) == ["c0"]  # 30 s and more without a turn
    never = scheduler(("c0", "colocated"), instance_stall_timeout_s=0.0)
    assert never.find_stalled(1e9) == []


def test_a_dead_instance_never_returns_in_its_epoch_only_a_replacement() -> None:
    gs = scheduler(("c0", "colocated"))
    send(gs, "r")
    gs.mark_started("r")
    assert gs.mark_dead("c0").retry == ["r"]  # fenced, or its process exited
    view = gs.views["c0"]
    assert view.epoch == 1 and view.stats == InstanceStats(num_free_blocks=100,
                                                           num_total_blocks=100)  # fmt: skip
    for epoch in (0, 1):  # its former life counts for nothing, whatever it claims
        assert not gs.observe("c0", None, 5.0, epoch=epoch) and not view.alive
    assert gs.mark_dead("c0").already_dead
    old = instance_info("c0", "colocated")
    with pytest.raises(ValueError, match="already retired"):
        gs.add_instance(old, now=6.0)
    replacement = gs.add_instance(msgspec.structs.replace(old, epoch=1), now=6.0)
    assert replacement.alive and gs.observe("c0", None, 7.0, epoch=1)
    send(gs, "next")
    assert "next" in replacement.in_flight


def test_a_prefill_death_spares_requests_whose_kv_reached_decode() -> None:
    gs = scheduler(("p0", "prefill"), ("d0", "decode"))
    for rid in ("handed", "prefilling"):
        send(gs, rid)
        gs.mark_started(rid)
    gs.release_prefill("handed")  # d0 sent its first output of it
    failover = gs.mark_dead("p0")
    assert failover.retry == ["prefilling"] and failover.abort == {("d0", "p0"): ["prefilling"]}
    assert "handed" in gs.assignments and "handed" in gs.views["d0"].in_flight


def test_a_request_out_of_retries_is_told_apart() -> None:
    gs = scheduler(("c0", "colocated"), ("c1", "colocated"), max_attempts=1)
    send(gs, "r")
    dead = gs.assignments["r"].route.decode.instance_id
    failover = gs.mark_dead(dead)
    assert failover.retry == [] and failover.fail == failover.exhausted == ["r"]
