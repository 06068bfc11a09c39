"""What split of the instance budget the SLOs want next: one pure decision per interval.

The policy reads one `Observation` (what the gateway saw over the last interval), forecasts
the next interval's load (`slo_forecast.py`), asks the calibrated step-latency model
(`planner/sim`, through `slo_split.py`) which prefill:decode split of the budget meets the
TTFT and ITL objectives with the most headroom, and answers one `Decision`. It does no I/O
and reads no clock: the controller (`gateway/slo_controller.py`) and the simulator drive
it alike. The types live in `slo_types.py` and are re-exported here.
"""

from __future__ import annotations

import math

import msgspec

from pdserve.gateway.slo_forecast import LoadForecaster
from pdserve.gateway.slo_split import SplitScore, SplitScorer, feasible_splits
from pdserve.gateway.slo_types import (
    Action,
    Arrival,
    Decision,
    Forecast,
    Observation,
    PolicyConfig,
    PoolObservation,
)
from pdserve.planner.sim.latency import Calibration

__all__ = [
    "Action",
    "Arrival",
    "Decision",
    "Forecast",
    "Observation",
    "PolicyConfig",
    "PoolObservation",
    "SloPolicy",
]

ROLES = ("prefill", "decode")


class SloPolicy:
    """Decides each interval's move from an `Observation` and the step-latency model.

    Holds, in this order: while an operator's change is in flight ("operator"), on stale
    figures or a gap between observations ("stale"), until the forecast rests on
    `min_arrivals` requests ("warming_up"), while an instance is still starting or
    switching ("settling"), within the cooldown after a move ("cooldown"). Otherwise it
    switches instances (up to `PolicyConfig.switch_batch()` at once) toward the split
    with the most headroom (among those that keep the ITL SLO, `choose_target`) once that
    split beats the current one by `switch_margin` for `persist_intervals` intervals in a
    row (a run of moves in one direction waits once; a reversal waits again), the growing
    pool's SLO is at risk (a split meeting both with the margin to spare stays:
    "slos_met") and the switch is worth what it costs (`weigh_switch`); it starts or stops
    instances only to bring the total to the budget.
    """

    def __init__(self, config: PolicyConfig, calibration: Calibration) -> None:
        config.check()
        if not feasible_splits(config):
            raise ValueError("no prefill:decode split fits the budget, floors and maxima")
        self.config = config
        self.calibration = calibration
        self.forecaster = LoadForecaster(config.forecast_halflife_s)
        self.scorer = SplitScorer(config, calibration)
        self.last_at: float | None = None
        self.last_move_at: float | None = None
        self.wanted: str | None = None  # the pool the last intervals wanted to grow
        self.wanted_for = 0  # consecutive intervals it was wanted

    def decide(self, observation: Observation) -> Decision:
        gap = None if self.last_at is None else observation.at - self.last_at
        self.last_at = observation.at
        self.forecaster.observe(observation.arrivals, observation.interval_s)
        load = self.forecaster.forecast()
        scores = self.scorer.score_all(load, observation)
        current = current_split(observation)
        target = choose_target(scores, current[0])
        decide = DecisionMaker(observation, load, target)
        held = self.hold_reason(observation, gap)
        if held is not None:
            if held[0] in ("operator", "stale"):
                self.forget_wish()  # what was wanted before is no evidence for after
            return decide.hold(*held)
        budget_total = target.prefill + target.decode
        current_score = self.score_current(current, load, observation)
        gain = target.headroom - current_score.headroom if current_score else float("inf")
        direction = switch_direction(current, (target.prefill, target.decode))
        margin = self.config.switch_margin
        reason = switch_reason(direction, current_score, margin) if direction else None
        if direction is None or gain < margin or reason is None:
            self.forget_wish()
            if sum(current) != budget_total:
                return self.resize(decide, current)
            if direction is not None and gain >= margin:
                # Both SLOs are met with the margin to spare: more headroom buys no
                # goodput, and a switch disrupts (see `weigh_switch`).
                return decide.hold(
                    "slos_met", f"{target.label()} gains {gain:+.2f}, but both SLOs are met"
                )
            reason = "on_target" if current == (target.prefill, target.decode) else "within_margin"
            return decide.hold(reason, f"{current_label(current)} gains {gain:+.2f} at best")
        if self.wanted != direction:
            self.wanted, self.wanted_for = direction, 0
        self.wanted_for += 1
        if self.wanted_for < self.config.persist_intervals:
            return decide.hold(
                "persisting",
                f"{direction} wanted {self.wanted_for}/{self.config.persist_intervals} "
                f"intervals (gain {gain:+.2f})",
            )
        source = "decode" if direction == "prefill" else "prefill"
        serving = getattr(observation, source).serving
        if serving < 1:
            return decide.hold("settling", f"no serving {source} instance to switch")
        short = (
            target.prefill - current[0] if direction == "prefill" else target.decode - current[1]
        )
        count = min(short, serving, self.config.switch_batch())
        costly = self.weigh_switch(decide, current_score, source)
        if costly is not None:
            if sum(current) != budget_total:
                return self.resize(decide, current)
            return costly
        self.last_move_at = observation.at
        return decide.move(
            "switch",
            reason,
            f"{count} {source} -> {direction}: {current_label(current)} headroom "
            f"{current_score.headroom if current_score else float('-inf'):+.2f}, "
            f"{target.label()} {target.headroom:+.2f}",
            source,
            direction,
            count,
        )

    def hold_reason(self, observation: Observation, gap: float | None) -> tuple[str, str] | None:
        config = self.config
        stale_s = config.stale_intervals * config.interval_s
        if observation.operator_change:
            return "operator", "an operator's change is in flight"
        if observation.data_age_s > stale_s:
            return "stale", f"pool figures are {observation.data_age_s:.1f} s old"
        if gap is not None and gap > stale_s:
            return "stale", f"no observation for {gap:.1f} s"
        if observation.interval_s > stale_s:
            return "stale", f"the interval lasted {observation.interval_s:.1f} s"
        seen = self.forecaster.arrivals
        if seen < config.min_arrivals:
            return "warming_up", f"the forecast rests on {seen} of {config.min_arrivals} requests"
        if observation.prefill.starting or observation.decode.starting:
            return "settling", "an instance is still starting or switching"
        if self.last_move_at is not None:
            since = observation.at - self.last_move_at
            if since < config.cooldown_intervals * config.interval_s:
                return "cooldown", f"last move {since:.1f} s ago"
        return None

    def weigh_switch(
        self, decide: DecisionMaker, current: SplitScore | None, source: str
    ) -> Decision | None:
        """A hold when switching decode instances costs what the target gains, else None.

        A decode instance leaves by handing its running requests back to be recomputed
        (their TPOT pays, and the prefill pool computes their prompts again): the target,
        once reached, must still beat the current split by `switch_margin` with every
        request its switches hand back queued for prefill and gone from decode.
        """
        observation = decide.observation
        running = observation.decode.running
        if source != "decode" or running == 0:
            return None
        target = decide.target
        decode = current_split(observation)[1]
        handed_back = math.ceil(running * (decode - target.decode) / max(decode, 1))
        after = handed_over(observation, handed_back)
        moved = self.scorer.score(target.prefill, target.decode, decide.load, after)
        gain = moved.headroom - (current.headroom if current is not None else -math.inf)
        if gain >= self.config.switch_margin:
            return None
        return decide.hold(
            "within_margin",
            f"{target.label()} gains {gain:+.2f} with the {handed_back} requests its "
            "switches hand back queued",
        )

    def forget_wish(self) -> None:
        self.wanted, self.wanted_for = None, 0

    def score_current(
        self, current: tuple[int, int], load: Forecast, observation: Observation
    ) -> SplitScore | None:
        prefill, decode = current
        if prefill < 1 or decode < 1:
            return None  # a split without one of the pools serves nobody
        return self.scorer.score(prefill, decode, load, observation)

    def resize(self, decide: DecisionMaker, current: tuple[int, int]) -> Decision:
        """Start or stop one instance toward the target's total, in the pool that needs it."""
        target = decide.target
        wants = {"prefill": target.prefill - current[0], "decode": target.decode - current[1]}
        if sum(current) < target.prefill + target.decode:
            role = max(ROLES, key=lambda r: wants[r])
            self.last_move_at = decide.observation.at
            return decide.move(
                "start", "below_budget", f"{current_label(current)} -> {target.label()}", None, role
            )
        role = min(ROLES, key=lambda r: wants[r])
        if getattr(decide.observation, role).serving < 1:
            return decide.hold("settling", f"no serving {role} instance to stop")
        self.last_move_at = decide.observation.at
        return decide.move(
            "stop", "over_budget", f"{current_label(current)} -> {target.label()}", None, role
        )


class DecisionMaker:
    """Builds one interval's `Decision` around the target it found."""

    def __init__(self, observation: Observation, load: Forecast, target: SplitScore) -> None:
        self.observation = observation
        self.load = load
        self.target = target

    def hold(self, reason: str, detail: str) -> Decision:
        return self.move("hold", reason, detail, None, None)

    def move(
        self,
        action: Action,
        reason: str,
        detail: str,
        role_from: str | None,
        role_to: str | None,
        count: int = 1,
    ) -> Decision:
        load = self.load
        forecast = (
            f" | {load.rate:.2f} req/s, {load.prompt_tokens:.0f}+{load.output_tokens:.0f} tok"
        )
        return Decision(
            at=self.observation.at,
            action=action,
            reason=reason,
            detail=detail + forecast,
            target_prefill=self.target.prefill,
            target_decode=self.target.decode,
            role_from=role_from,
            role_to=role_to,
            forecast=load,
            headroom=self.target.headroom,
            count=count,
        )


def current_split(observation: Observation) -> tuple[int, int]:
    """Instances each pool has or is about to have."""
    prefill, decode = observation.prefill, observation.decode
    return prefill.serving + prefill.starting, decode.serving + decode.starting


def choose_target(scores: list[SplitScore], current_prefill: int) -> SplitScore:
    """The most headroom among the splits that keep the ITL SLO, where any does; among
    equals (within rounding) the split nearest the current. A decode pool past the ITL SLO
    makes every request it runs miss at once, while a prefill pool short of work only
    delays the requests that arrive: with every split missing the TTFT SLO (a burst of
    long prompts), the one with the most headroom would take decode instances until the
    running requests' steps slow past the SLO."""
    scores = [s for s in scores if s.itl_margin >= 0.0] or scores
    best = max(score.headroom for score in scores)
    near_best = [s for s in scores if s.headroom >= best - 1e-9]
    return min(near_best, key=lambda s: abs(s.prefill - current_prefill))


def switch_direction(current: tuple[int, int], target: tuple[int, int]) -> str | None:
    """The pool a switch would grow: one pool under its target while the other is over."""
    if current[0] < target[0] and current[1] > target[1]:
        return "prefill"
    if current[1] < target[1] and current[0] > target[0]:
        return "decode"
    return None


def switch_reason(direction: str, current: SplitScore | None, comfortable: float) -> str | None:
    """ "ttft_risk" / "itl_risk" when the growing pool's SLO margin is under `comfortable`
    (or the other pool is empty), else None: both SLOs are met."""
    if current is None:
        return f"{'ttft' if direction == 'prefill' else 'itl'}_risk"
    growing = current.ttft_margin if direction == "prefill" else current.itl_margin
    if growing < comfortable:
        return "ttft_risk" if direction == "prefill" else "itl_risk"
    return None


def handed_over(observation: Observation, requests: int) -> Observation:
    """The observation with `requests` of the decode pool's running requests queued for
    prefill instead."""
    prefill, decode = observation.prefill, observation.decode
    return msgspec.structs.replace(
        observation,
        prefill=msgspec.structs.replace(prefill, queued=prefill.queued + requests),
        decode=msgspec.structs.replace(decode, running=max(decode.running - requests, 0)),
    )


def current_label(current: tuple[int, int]) -> str:
    return f"{current[0]}P+{current[1]}D"
