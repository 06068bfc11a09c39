"""The SLO controller without processes: a fake clock, a gateway's books (a real global
scheduler and metrics), a pool control that starts nothing and a scripted policy.

It observes each pool and the traffic since its last look, holds on stale data, while
an operator's change runs, while its own move runs and just after one, and outside the
budget; a policy that raises is a hold; a switch runs through the claim and the
`RoleSwitcher`, a stop through the admin drain; paused, it decides nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import pytest

from pdserve.common.messages import InstanceAddress, InstanceStats, SwitchRoleTask
from pdserve.gateway.global_scheduler import GlobalScheduler
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.pool_changes import InstanceClaims
from pdserve.gateway.slo_controller import SloController
from pdserve.gateway.slo_policy import Decision, Forecast, Observation, PolicyConfig
from pdserve.gateway.slo_samples import SloSamples
from tests.gateway.instances import instance_info

INTERVAL_S = 5.0
# The policy settings' default: moves this far apart.
COOLDOWN_S = PolicyConfig(2, ttft_slo_ms=1.0, itl_slo_ms=1.0).cooldown_intervals * INTERVAL_S


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakePools:
    """The cluster's `PoolControl` (`cluster/pools.py`) without processes."""

    def __init__(self, roles: dict[str, str]) -> None:
        self.roles = dict(roles)  # member → pool
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.moved: dict[str, str] = {}
        self.cannot_start: str | None = None  # why `start` fails (None: it starts)

    def members(self, role: str) -> list[str]:
        return sorted(i for i, r in self.roles.items() if r == role)

    def max_size(self, role: str) -> int | None:
        return None

    def start(self, role: str, count: int) -> list[str]:
        if self.cannot_start is not None:
            raise ValueError(self.cannot_start)
        ids = [f"{role}-{len(self.roles) + n}" for n in range(count)]
        self.roles.update(dict.fromkeys(ids, role))
        self.started += ids
        return ids

    def retire(self, instance_id: str) -> None:
        self.roles.pop(instance_id, None)

    def stop(self, instance_id: str) -> None:
        self.stopped.append(instance_id)

    def fit(self, instance_id: str, role: str) -> str | None:
        return None

    def move(self, instance_id: str, role: str) -> None:
        self.roles[instance_id] = role
        self.moved[instance_id] = role


@dataclass
class FakeDispatcher:
    tasks: list[tuple[str, object]] = field(default_factory=list)

    def send_task(self, instance_id: str, task: object) -> bool:
        self.tasks.append((instance_id, task))
        return True

    def migrate(self, request_id: str, reason: str, avoid: frozenset[str]) -> None:
        raise AssertionError("no request runs on the switching instance here")


class FakeGateway:
    """What the controller reads of `Gateway`: its books, pools, samples and metrics."""

    def __init__(self, clock: Clock, roles: dict[str, str]) -> None:
        self.scheduler = GlobalScheduler()
        self.metrics = GatewayMetrics()
        self.dispatcher = FakeDispatcher()
        self.pools: FakePools | None = FakePools(roles)
        self.claims = InstanceClaims()
        self.slo_samples = SloSamples()
        self.not_ready: str | None = None
        for instance_id, role in roles.items():
            self.scheduler.add_instance(instance_info(instance_id, role), clock())

    def not_ready_reason(self) -> str | None:
        return self.not_ready


class Script:
    """A policy that answers with `decide_with(observation)` and keeps what it saw."""

    def __init__(self, decide_with: Callable[[Observation], Decision]) -> None:
        self.decide_with = decide_with
        self.seen: list[Observation] = []

    def decide(self, observation: Observation) -> Decision:
        self.seen.append(observation)
        return self.decide_with(observation)


def move(action: str, role_to: str, role_from: str | None = None, count: int = 1) -> Callable:
    def decide(observation: Observation) -> Decision:
        forecast = Forecast(rate=2.0, prompt_tokens=100.0, output_tokens=20.0)
        at, targets = observation.at, (2, 1)
        return Decision(
            at, action, "ttft_risk", "scripted", *targets, role_from, role_to, forecast, count=count
        )

    return decide


ONE_P_TWO_D = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}


def controller_for(decide_with: Callable, budget: int = 4, roles: dict | None = None):
    clock = Clock()
    gateway = FakeGateway(clock, roles or ONE_P_TWO_D)
    policy = Script(decide_with)
    config = PolicyConfig(budget, ttft_slo_ms=500.0, itl_slo_ms=50.0, interval_s=INTERVAL_S)
    controller = SloController(gateway, policy, config, clock)  # type: ignore[arg-type]
    return controller, gateway, policy, clock


def next_interval(gateway: FakeGateway, clock: Clock, seconds: float = INTERVAL_S) -> None:
    """Time passes and every instance heartbeats."""
    clock.now += seconds
    for view in gateway.scheduler.views.values():
        view.last_seen = clock.now


def count(gateway: FakeGateway, action: str, reason: str) -> float:
    text = gateway.metrics.render().decode()
    line = f'pdserve:controller_decisions_total{{action="{action}",reason="{reason}"}} '
    found = [row for row in text.splitlines() if row.startswith(line)]
    return float(found[0].split()[-1]) if found else 0.0


def test_each_interval_observes_the_pools_and_the_traffic_since_the_last() -> None:
    controller, gateway, policy, clock = controller_for(move("hold", "decode"))
    stats = InstanceStats(num_running=3, num_waiting=2, kv_cache_usage_perc=0.5,
                          num_free_blocks=50, num_total_blocks=100)  # fmt: skip
    gateway.scheduler.observe("decode-0", stats, clock())
    gateway.scheduler.observe("decode-1", InstanceStats(num_running=1, num_total_blocks=100),
                              clock())  # fmt: skip
    gateway.slo_samples.add_ttft(0.25)
    gateway.slo_samples.add_gap(0.01)
    gateway.slo_samples.add_arrival(120, 30)
    next_interval(gateway, clock, 4.0)
    decision = controller.tick()
    assert decision is not None and decision.action == "hold"
    seen = policy.seen[-1]
    assert (seen.at, seen.interval_s) == (clock(), 4.0)
    assert seen.decode.serving == 2 and seen.prefill.serving == 1
    assert (seen.decode.running, seen.decode.queued, seen.decode.kv_usage) == (4, 2, 0.25)
    assert seen.ttft_ms == (250.0,) and seen.itl_ms == (10.0,)
    assert [(a.prompt_tokens, a.max_tokens) for a in seen.arrivals] == [(120, 30)]
    assert not seen.operator_change
    next_interval(gateway, clock)
    controller.tick()
    assert policy.seen[-1].ttft_ms == () and policy.seen[-1].arrivals == ()  # taken once


def test_a_loading_member_is_starting_and_an_operators_scale_up() -> None:
    controller, gateway, policy, clock = controller_for(move("start", "decode"))
    assert gateway.pools is not None
    gateway.pools.roles["decode-5"] = "decode"  # an admin scale-up, still loading
    next_interval(gateway, clock)
    decision = controller.tick()
    assert policy.seen[-1].decode.starting == 1 and policy.seen[-1].operator_change
    assert decision is not None
    assert (decision.action, decision.reason) == ("hold", "operator_change")
    assert gateway.pools.started == []


def test_an_operators_change_in_flight_holds_every_move() -> None:
    controller, gateway, policy, clock = controller_for(move("start", "prefill"))
    assert gateway.pools is not None
    gateway.claims.claim("decode-1")  # an admin switch of decode-1 runs
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and (decision.action, decision.reason) == (
        "hold",
        "operator_change",
    )
    assert "the policy asked to start" in decision.detail and gateway.pools.started == []
    gateway.claims.release("decode-1")
    next_interval(gateway, clock, COOLDOWN_S)
    assert controller.tick().action == "start"  # type: ignore[union-attr]
    assert gateway.pools.started == ["prefill-3"]


def test_stale_data_holds_without_asking_the_policy() -> None:
    controller, gateway, policy, clock = controller_for(move("start", "prefill"))
    clock.now += INTERVAL_S * 2  # nobody heartbeats
    decision = controller.tick()
    assert decision is not None and decision.reason == "stale" and policy.seen == []
    assert "prefill-0" in decision.detail


def test_a_policy_that_raises_is_a_hold_and_counted() -> None:
    def fail(observation: Observation) -> Decision:
        raise NotImplementedError("the policy is being written")

    controller, gateway, policy, clock = controller_for(fail)
    for _ in range(2):
        next_interval(gateway, clock)
        decision = controller.tick()
        assert decision is not None and (decision.action, decision.reason) == (
            "hold",
            "policy_error",
        )
    assert "NotImplementedError" in decision.detail
    assert count(gateway, "hold", "policy_error") == 2.0


def test_a_start_stays_within_the_budget_and_one_move_at_a_time() -> None:
    controller, gateway, policy, clock = controller_for(move("start", "prefill"), budget=4)
    assert gateway.pools is not None
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and decision.action == "start" and "[prefill-3]" in decision.detail
    next_interval(gateway, clock, COOLDOWN_S)
    decision = controller.tick()  # prefill-3 still loads
    assert decision is not None and decision.reason == "move_in_flight"
    gateway.scheduler.add_instance(instance_info("prefill-3", "prefill"), clock())
    next_interval(gateway, clock, COOLDOWN_S)
    decision = controller.tick()
    assert decision is not None and decision.reason == "out_of_bounds"
    assert "--instance-budget 4" in decision.detail and gateway.pools.started == ["prefill-3"]
    assert count(gateway, "start", "ttft_risk") == 1.0
    text = gateway.metrics.render().decode()
    assert 'pdserve:controller_actual_instances{role="prefill"} 2.0' in text
    assert 'pdserve:controller_target_instances{role="prefill"} 2.0' in text


def test_a_move_the_pools_refuse_is_a_hold() -> None:
    controller, gateway, policy, clock = controller_for(move("start", "decode"))
    assert gateway.pools is not None
    gateway.pools.cannot_start = "this launcher cannot start instances"
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and (decision.action, decision.reason) == ("hold", "cannot_act")
    assert decision.detail.startswith("this launcher cannot start instances")
    next_interval(gateway, clock)  # no move was made: no cooldown either
    gateway.pools.cannot_start = None
    assert controller.tick().action == "start"  # type: ignore[union-attr]


def test_moves_are_rate_limited() -> None:
    controller, gateway, policy, clock = controller_for(move("start", "prefill"), budget=6)
    next_interval(gateway, clock)
    assert controller.tick().action == "start"  # type: ignore[union-attr]
    gateway.scheduler.add_instance(instance_info("prefill-3", "prefill"), clock())
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and decision.reason == "cooldown"


def test_a_switch_runs_through_the_claim_and_the_role_switch() -> None:
    asyncio.run(_a_switch_runs_through_the_claim_and_the_role_switch())


async def _a_switch_runs_through_the_claim_and_the_role_switch() -> None:
    controller, gateway, policy, clock = controller_for(move("switch", "prefill", "decode"))
    assert gateway.pools is not None
    gateway.scheduler.views["decode-0"].in_flight.add("busy-request")  # decode-1 is lighter
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and decision.action == "switch" and "[decode-1]" in decision.detail
    assert gateway.claims.busy("decode-1")  # claimed at once
    await asyncio.sleep(0.1)
    assert gateway.scheduler.views["decode-1"].draining
    assert gateway.dispatcher.tasks == [("decode-1", SwitchRoleTask("prefill"))]
    next_interval(gateway, clock, COOLDOWN_S)
    assert controller.tick().reason == "move_in_flight"  # type: ignore[union-attr]
    info = instance_info("decode-1", "prefill")
    address = InstanceAddress("decode-1", "prefill", info.address.task_address)
    gateway.scheduler.switch_role(msgspec.structs.replace(info, address=address, epoch=1), clock())
    await asyncio.sleep(0.1)
    assert gateway.pools.moved == {"decode-1": "prefill"} and not gateway.claims.busy("decode-1")
    next_interval(gateway, clock, COOLDOWN_S)
    decision = controller.tick()  # decode-0 is the last decode instance
    assert decision is not None and decision.reason == "out_of_bounds"
    assert "below --min-decode 1" in decision.detail


def test_a_switch_of_several_claims_the_least_loaded_each_and_stays_in_bounds() -> None:
    asyncio.run(_a_switch_of_several())


async def _a_switch_of_several() -> None:
    roles = {"prefill-0": "prefill", **{f"decode-{i}": "decode" for i in range(4)}}
    controller, gateway, _, clock = controller_for(
        move("switch", "prefill", "decode", count=2), budget=5, roles=roles
    )
    assert gateway.pools is not None
    for busy in ("decode-0", "decode-2"):
        gateway.scheduler.views[busy].in_flight.add(f"request-on-{busy}")
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and decision.action == "switch" and decision.count == 2
    assert "[decode-1, decode-3]" in decision.detail
    assert gateway.claims.busy("decode-1") and gateway.claims.busy("decode-3")
    assert not gateway.claims.busy("decode-0") and not gateway.claims.busy("decode-2")
    await asyncio.sleep(0.1)
    assert sorted(i for i, _ in gateway.dispatcher.tasks) == ["decode-1", "decode-3"]

    # Four of four would leave no decode instance: vetoed whole, nothing claimed.
    controller, gateway, _, clock = controller_for(
        move("switch", "prefill", "decode", count=4), budget=5, roles=roles
    )
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and decision.reason == "out_of_bounds"
    assert not any(gateway.claims.busy(i) for i in roles)


def test_a_switch_out_of_decode_takes_the_instance_with_the_least_to_recompute() -> None:
    asyncio.run(_a_switch_out_of_decode_takes_the_least_to_recompute())


async def _a_switch_out_of_decode_takes_the_least_to_recompute() -> None:
    # decode-0 runs one long request (90 of 100 blocks), decode-1 two short ones (10): its
    # requests are handed back to be computed again, so decode-1 costs less.
    controller, gateway, _, clock = controller_for(move("switch", "prefill", "decode"))
    for instance_id, running, free in (("decode-0", 1, 10), ("decode-1", 2, 90)):
        stats = InstanceStats(num_running=running, num_free_blocks=free, num_total_blocks=100)
        gateway.scheduler.observe(instance_id, stats, clock())
        for n in range(running):
            gateway.scheduler.views[instance_id].in_flight.add(f"{instance_id}-request-{n}")
    gateway.dispatcher.migrate = lambda *args: None  # type: ignore[method-assign]
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and decision.action == "switch" and "[decode-1]" in decision.detail
    assert gateway.claims.busy("decode-1") and not gateway.claims.busy("decode-0")
    await asyncio.sleep(0.1)
    assert gateway.scheduler.views["decode-1"].draining  # its requests move, then it switches


def test_a_stop_drains_the_least_loaded_instance_for_good() -> None:
    asyncio.run(_a_stop_drains_the_least_loaded_instance_for_good())


async def _a_stop_drains_the_least_loaded_instance_for_good() -> None:
    controller, gateway, policy, clock = controller_for(move("stop", "decode"))
    assert gateway.pools is not None
    gateway.scheduler.views["decode-1"].in_flight.add("busy-request")
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and decision.action == "stop" and "[decode-0]" in decision.detail
    await asyncio.sleep(0.3)
    assert gateway.pools.stopped == ["decode-0"]
    assert "decode-0" not in gateway.pools.members("decode")  # retired: never restarted


def test_paused_it_decides_nothing_and_resumes() -> None:
    controller, gateway, policy, clock = controller_for(move("start", "prefill"))
    controller.pause(True)
    next_interval(gateway, clock)
    assert controller.tick() is None and policy.seen == [] and not controller.decisions
    controller.pause(False)
    next_interval(gateway, clock)
    assert controller.tick().action == "start"  # type: ignore[union-attr]


def test_the_snapshot_shows_state_forecast_and_decisions() -> None:
    controller, gateway, policy, clock = controller_for(move("hold", "decode"))
    next_interval(gateway, clock)
    controller.tick()
    clock.now += 1.5
    body = controller.snapshot()
    assert body["enabled"] and not body["paused"] and body["budget"] == 4
    assert body["target"] == {"prefill": 2, "decode": 1}
    assert body["actual"] == {"prefill": 1, "decode": 2}
    assert body["forecast"] == {
        "rate": 2.0,
        "prompt_tokens": 100.0,
        "output_tokens": 20.0,
        "prompt_tokens_sq": 0.0,
        "classes": (),
    }
    (only,) = body["decisions"]
    assert (only["action"], only["reason"], only["age_s"]) == ("hold", "ttft_risk", 1.5)


@pytest.mark.parametrize("reason", ["not_ready", "no_pool_control"])
def test_nothing_to_act_on_holds(reason: str) -> None:
    controller, gateway, policy, clock = controller_for(move("start", "prefill"))
    if reason == "not_ready":
        gateway.not_ready = "starting: 1/3 instances ready"
    else:
        gateway.pools = None
    next_interval(gateway, clock)
    decision = controller.tick()
    assert decision is not None and decision.reason == reason and policy.seen == []
