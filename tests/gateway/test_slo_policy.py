"""SloPolicy on scripted observations: stale data, flapping, floors, budget, operator, mixes."""

from __future__ import annotations

import pytest

from pdserve.gateway.slo_policy import (
    Arrival,
    Decision,
    Observation,
    PolicyConfig,
    PoolObservation,
    SloPolicy,
)
from pdserve.planner.sim.latency import Calibration, StepLatencyModel

# A GPU-like step model: a 2048-token prefill step ~1.1 s, a decode step 30 ms + 0.4 ms/seq.
CALIBRATION = Calibration(
    prefill=StepLatencyModel(intercept_s=0.05, per_token_s=0.0005),
    decode=StepLatencyModel(intercept_s=0.03, per_token_s=0.0004),
)
INTERVAL = 2.0
RAG = Arrival(prompt_tokens=2000, max_tokens=40)
CHAT = Arrival(prompt_tokens=200, max_tokens=450)


def config(**overrides) -> PolicyConfig:
    # Scripted loads act from their first interval (see the warming-up test).
    values = dict(
        instance_budget=8, ttft_slo_ms=3000.0, itl_slo_ms=100.0, interval_s=INTERVAL, min_arrivals=0
    )
    values.update(overrides)
    return PolicyConfig(**values)  # type: ignore[arg-type]


def arrivals(kind: Arrival, rate: float) -> tuple[Arrival, ...]:
    return (kind,) * round(rate * INTERVAL)


class ScriptedPools:
    """Pools whose moves complete at once, observed every interval."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.prefill, self.decode = prefill, decode
        self.at = 0.0

    def observe(self, batch: tuple[Arrival, ...], **extra) -> Observation:
        self.at += INTERVAL
        values = dict(
            at=self.at,
            interval_s=INTERVAL,
            prefill=PoolObservation(self.prefill, 0, 0, 0, 0.0),
            decode=PoolObservation(self.decode, 0, 0, 0, 0.1),
            ttft_ms=(),
            itl_ms=(),
            arrivals=batch,
            operator_change=False,
        )
        values.update(extra)
        return Observation(**values)  # type: ignore[arg-type]

    def apply(self, decision: Decision) -> None:
        step = {"prefill": (1, 0), "decode": (0, 1)}
        if decision.action == "switch":
            gain, loss = step[decision.role_to or ""], step[decision.role_from or ""]
            self.prefill += (gain[0] - loss[0]) * decision.count
            self.decode += (gain[1] - loss[1]) * decision.count
        elif decision.action in ("start", "stop"):
            sign = 1 if decision.action == "start" else -1
            delta = step[decision.role_to or ""]
            self.prefill += sign * delta[0]
            self.decode += sign * delta[1]

    def drive(self, policy: SloPolicy, batches: list[tuple[Arrival, ...]]) -> list[Decision]:
        decisions = []
        for batch in batches:
            decision = policy.decide(self.observe(batch))
            self.apply(decision)
            decisions.append(decision)
        return decisions


def moves(decisions: list[Decision]) -> list[Decision]:
    return [d for d in decisions if d.action != "hold"]


@pytest.mark.parametrize(
    ("start", "phase", "rate", "role", "reasons", "least"),
    [
        ((4, 4), RAG, 5.0, "prefill", ("ttft_risk", "slos_met"), 6),
        ((6, 2), CHAT, 8.0, "decode", ("itl_risk", "slos_met"), 3),
    ],
    ids=["a-rag-burst-grows-prefill", "a-chat-phase-grows-decode"],
)
def test_a_phase_grows_the_pool_it_loads(start, phase, rate, role, reasons, least) -> None:
    """`reasons`: the first move's, and the last hold's once it settles (where both SLOs
    are met with the switch margin to spare, whatever headroom is left to gain)."""
    pools = ScriptedPools(*start)
    decisions = pools.drive(SloPolicy(config(), CALIBRATION), [arrivals(phase, rate)] * 12)
    switches = moves(decisions)
    assert switches and all(d.role_to == role for d in switches)
    assert (switches[0].reason, decisions[-1].reason) == reasons
    assert getattr(pools, role) >= least and pools.prefill + pools.decode == 8


def test_a_large_budget_moves_several_instances_per_switch() -> None:
    pools = ScriptedPools(32, 32)
    policy = SloPolicy(config(instance_budget=64), CALIBRATION)
    decisions = pools.drive(policy, [arrivals(RAG, 40.0)] * 4)
    switches = moves(decisions)
    assert switches and switches[0].count == 4  # a sixteenth of the budget at once
    assert all(d.role_to == "prefill" and 1 <= d.count <= 4 for d in switches)
    assert pools.prefill + pools.decode == 64
    # Never past the target, whatever the batch.
    pools = ScriptedPools(4, 4)
    few = pools.drive(SloPolicy(config(max_switches=8), CALIBRATION), [arrivals(RAG, 5.0)] * 6)
    assert all(d.count <= d.target_prefill - 4 for d in moves(few)[:1])
    assert pools.prefill <= max(d.target_prefill for d in few) and pools.decode >= 1


def test_a_move_waits_for_the_wish_to_persist() -> None:
    pools = ScriptedPools(4, 4)
    decisions = pools.drive(
        SloPolicy(config(persist_intervals=3), CALIBRATION), [arrivals(RAG, 5.0)] * 3
    )
    assert [d.reason for d in decisions] == ["persisting", "persisting", "ttft_risk"]


def test_oscillating_load_does_not_flap() -> None:
    pools = ScriptedPools(4, 4)
    batches = [arrivals(RAG, 5.0) if i % 2 else arrivals(CHAT, 8.0) for i in range(40)]
    switches = moves(pools.drive(SloPolicy(config(), CALIBRATION), batches))
    directions = [d.role_to for d in switches]
    reversals = sum(a != b for a, b in zip(directions, directions[1:], strict=False))
    assert reversals == 0, directions
    assert len(switches) <= 3


def test_stale_figures_and_missing_intervals_hold() -> None:
    policy = SloPolicy(config(), CALIBRATION)
    pools = ScriptedPools(4, 4)
    old = policy.decide(pools.observe(arrivals(RAG, 5.0), data_age_s=7.0))
    assert (old.action, old.reason) == ("hold", "stale")
    pools.at += 10 * INTERVAL  # ten intervals never observed
    gap = policy.decide(pools.observe(arrivals(RAG, 5.0)))
    assert (gap.action, gap.reason) == ("hold", "stale")
    # Fresh again: the wish starts over, so a move needs its persistence first.
    fresh = policy.decide(pools.observe(arrivals(RAG, 5.0)))
    assert fresh.reason == "persisting"


def test_an_operator_change_in_flight_wins() -> None:
    policy = SloPolicy(config(), CALIBRATION)
    pools = ScriptedPools(4, 4)
    for _ in range(6):
        decision = policy.decide(pools.observe(arrivals(RAG, 5.0), operator_change=True))
        assert (decision.action, decision.reason) == ("hold", "operator")
        assert decision.target_prefill > 4  # it still says what it would want
    assert (pools.prefill, pools.decode) == (4, 4)


def test_floors_and_maxima_hold_under_pressure() -> None:
    pools = ScriptedPools(4, 4)
    policy = SloPolicy(config(min_decode=3, max_prefill=5), CALIBRATION)
    decisions = pools.drive(policy, [arrivals(RAG, 50.0)] * 20)
    assert (pools.prefill, pools.decode) == (5, 3)
    assert all(d.target_prefill <= 5 and d.target_decode >= 3 for d in decisions)
    pools = ScriptedPools(4, 4)
    decisions = pools.drive(SloPolicy(config(), CALIBRATION), [arrivals(CHAT, 200.0)] * 20)
    assert pools.prefill >= 1 and pools.prefill + pools.decode == 8


def test_the_budget_is_filled_and_never_exceeded() -> None:
    policy = SloPolicy(config(), CALIBRATION)
    pools = ScriptedPools(3, 4)  # an instance gone
    first = policy.decide(pools.observe(arrivals(CHAT, 1.0)))
    assert (first.action, first.reason) == ("start", "below_budget")
    policy = SloPolicy(config(), CALIBRATION)
    pools = ScriptedPools(5, 5)
    over = policy.decide(pools.observe(arrivals(CHAT, 1.0)))
    assert (over.action, over.reason) == ("stop", "over_budget")
    pools = ScriptedPools(4, 4)
    decisions = pools.drive(SloPolicy(config(), CALIBRATION), [arrivals(CHAT, 8.0)] * 30)
    assert all(d.target_prefill + d.target_decode == 8 for d in decisions)
    assert not any(d.action == "start" for d in decisions)


def test_a_cooldown_follows_each_move() -> None:
    pools = ScriptedPools(4, 4)
    policy = SloPolicy(config(cooldown_intervals=3), CALIBRATION)
    decisions = pools.drive(policy, [arrivals(RAG, 5.0)] * 6)
    reasons = [d.reason for d in decisions]
    assert reasons[:5] == ["persisting", "ttft_risk", "cooldown", "cooldown", "ttft_risk"]


def test_each_decision_says_why_in_one_line() -> None:
    pools = ScriptedPools(4, 4)
    for decision in pools.drive(SloPolicy(config(), CALIBRATION), [arrivals(RAG, 5.0)] * 4):
        assert decision.reason and "\n" not in decision.detail
        assert decision.forecast is not None and decision.forecast.rate == pytest.approx(5.0)


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="min_prefill"):
        SloPolicy(config(min_prefill=0), CALIBRATION)
    with pytest.raises(ValueError, match="below min_prefill"):
        SloPolicy(config(instance_budget=1), CALIBRATION)
    with pytest.raises(ValueError, match="max_decode 1 is below min_decode 2"):
        SloPolicy(config(min_decode=2, max_decode=1), CALIBRATION)


def queued_rag(pools: ScriptedPools, policy: SloPolicy, queued: int, running: int) -> Decision:
    """Two intervals of RAG at 3/s with `queued` prompts waiting and `running` decoding."""
    for _ in range(2):
        decision = policy.decide(
            pools.observe(
                arrivals(RAG, 3.0),
                prefill=PoolObservation(pools.prefill, 0, queued, 4, 0.0),
                decode=PoolObservation(pools.decode, 0, 0, running, 0.1),
            )
        )
        pools.apply(decision)
    return decision


def test_a_split_that_meets_both_slos_stays() -> None:
    # 7P+1D has more headroom, but 4P+4D meets both SLOs: a switch would only disrupt.
    met = queued_rag(ScriptedPools(4, 4), SloPolicy(config(), CALIBRATION), 4, running=0)
    assert (met.action, met.reason, met.target_prefill) == ("hold", "slos_met", 7)
    assert met.headroom is not None and met.headroom > 0.1


def test_a_switch_out_of_decode_counts_the_requests_it_hands_back() -> None:
    # TTFT at risk: a switch is wanted, and taken while the decode pool is idle.
    idle = queued_rag(ScriptedPools(4, 4), SloPolicy(config(), CALIBRATION), 5, running=0)
    assert (idle.action, idle.reason) == ("switch", "ttft_risk")
    # With 10 RAG requests per decode instance, reaching 7P+1D hands 30 back to be
    # prefilled again: worse than waiting.
    busy = queued_rag(ScriptedPools(4, 4), SloPolicy(config(), CALIBRATION), 5, running=40)
    assert (busy.action, busy.reason) == ("hold", "within_margin")
    assert "30 requests its switches hand back" in busy.detail


@pytest.mark.parametrize(("start", "action"), [((4, 5), "stop"), ((3, 4), "start")])
def test_a_held_switch_still_brings_the_total_to_the_budget(start, action) -> None:
    # RAG wants more prefill, but once both SLOs are met the switch is held: the total
    # still comes back to the budget.
    pools = ScriptedPools(*start)
    policy = SloPolicy(config(), CALIBRATION)
    decisions = []
    for _ in range(8):
        decisions.append(
            policy.decide(
                pools.observe(
                    arrivals(RAG, 3.0), prefill=PoolObservation(pools.prefill, 0, 4, 4, 0.0)
                )
            )
        )
        pools.apply(decisions[-1])
    assert action in [d.action for d in decisions]
    assert pools.prefill + pools.decode == 8
    assert decisions[-1].reason == "slos_met"


def test_prefill_overloaded_at_every_split_does_not_take_decode_past_its_slo() -> None:
    # RAG at 10/s wants ~10.5 prefill instances of 8; 240 chat requests decode. Every split
    # misses the TTFT SLO, and only a single decode instance misses the ITL one too (240
    # sequences a step): the prefill pool grows to 6P+2D, never to 7P+1D, whose slower
    # steps would make every running request miss.
    policy = SloPolicy(config(), CALIBRATION)
    pools = ScriptedPools(4, 4)
    for _ in range(8):
        decision = policy.decide(
            pools.observe(
                arrivals(RAG, 10.0),
                prefill=PoolObservation(pools.prefill, 0, 8, 4, 0.0),
                decode=PoolObservation(pools.decode, 0, 0, 240, 0.3),
            )
        )
        assert decision.target_prefill == 6, decision.detail
        pools.apply(decision)
    assert (pools.prefill, pools.decode) == (6, 2)


def test_no_move_before_the_forecast_rests_on_enough_requests() -> None:
    # Two RAG prompts a second from the first interval on: 4 requests an interval, so the
    # third interval is the first with 10 behind the forecast.
    policy = SloPolicy(config(min_arrivals=10), CALIBRATION)
    pools = ScriptedPools(4, 4)
    decisions = pools.drive(policy, [arrivals(RAG, 2.0)] * 3)
    assert [d.reason for d in decisions[:2]] == ["warming_up", "warming_up"]
    assert "rests on 8 of 10 requests" in decisions[1].detail
    assert decisions[2].reason != "warming_up"
    with pytest.raises(ValueError, match="min_arrivals"):
        SloPolicy(config(min_arrivals=-1), CALIBRATION)
