"""The SLO controller: every interval it observes the pools, asks the policy for a move
and carries it out through the pools' control, on the gateway's event loop.

One interval: an `Observation` (`slo_observation.py`: both pools, the TTFTs, gaps and
arrivals since the last one), then one `Decision`. The controller holds still without
asking the policy while the deployment is not ready, has no pool control, or a serving
instance's news is older than an interval (stale data; at least `STALE_FLOOR_S`). It asks the policy
(`SloPolicy`, or any object with its `decide`); a policy that raises is a hold with
reason "policy_error", never a failure of the gateway. It vetoes a move (a hold naming
why) while an operator's drain, scale or switch runs (the operator wins), while its own
last move is under way, within `PolicyConfig.cooldown_intervals` intervals of it, or when the move
would leave the budget or a pool's bounds. A move runs the admin routes' code
(`pool_changes.py`): "switch" the least-loaded serving instance of `role_from` through
its claim and `RoleSwitcher`, "start" one more instance of the pool, "stop" the
least-loaded one drained for good. Every decision is logged in one line, counted in
`pdserve:controller_decisions_total{action,reason}` and kept (the latest
`KEPT_DECISIONS`, for `GET /admin/controller`). Paused by an operator, it observes (the
samples do not pile up) and decides nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pdserve.gateway.controller_metrics import ControllerSeries
from pdserve.gateway.pool_changes import PoolChanges
from pdserve.gateway.slo_observation import POOLS, SloObserver
from pdserve.gateway.slo_policy import Decision, Forecast, Observation, PolicyConfig
from pdserve.planner.sim.latency import Calibration, load_calibration

if TYPE_CHECKING:
    from pdserve.gateway.gateway import Gateway
    from pdserve.gateway.routing import InstanceView

logger = logging.getLogger(__name__)

KEPT_DECISIONS = 100
# News older than an interval is stale, and never younger than this: instances
# heartbeat every 0.5 s, so a short interval would otherwise take a late beat for silence.
STALE_FLOOR_S = 2.0


class Policy(Protocol):
    def decide(self, observation: Observation) -> Decision: ...


@dataclass(frozen=True)
class AutoscaleConfig:
    """`pdserve serve --autoscale slo`'s settings, checked by the cluster's flags."""

    policy: PolicyConfig
    calibration: Calibration


def read_calibration(path: str) -> Calibration:
    """The step-latency model `pdserve bench calibrate` wrote (ValueError: one line)."""
    return load_calibration(path)


class CannotAct(Exception):
    """A move the pools cannot make now; the message says why."""


class SloController:
    def __init__(
        self,
        gateway: Gateway,
        policy: Policy,
        config: PolicyConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the gateway's monotonic clock (heartbeats are dated on it)."""
        self.gateway = gateway
        self.policy = policy
        self.config = config
        self.clock = clock
        self.series = ControllerSeries(gateway.metrics.registry)
        self.observer = SloObserver(gateway)
        self.changes = PoolChanges(gateway)  # the admin routes' drains and switches
        self.decisions: deque[Decision] = deque(maxlen=KEPT_DECISIONS)
        self.paused = False
        self.forecast: Forecast | None = None
        self.target: tuple[int, int] | None = None  # the latest decision's split
        self.actual = (0, 0)  # serving at the latest look
        self._moves: dict[str, Callable[[], bool]] = {}  # our moves: instance → ended?
        self._last_move_at = -math.inf
        self._last_tick = clock()
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle (event loop) -------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.tick()
            except Exception:  # a fault of ours: this interval holds, the next tries again
                logger.exception("SLO controller: the interval failed; holding")

    def pause(self, paused: bool) -> None:
        if paused != self.paused:
            logger.warning("SLO controller: %s by an operator", "paused" if paused else "resumed")
        self.paused = paused

    # ---- one interval -----------------------------------------------------------------

    def tick(self) -> Decision | None:
        """Observes, decides and acts once (None: paused)."""
        now = self.clock()
        interval_s, self._last_tick = now - self._last_tick, now
        self._moves = {i: ended for i, ended in self._moves.items() if not ended()}
        observation = self.observer.observe(now, interval_s, set(self._moves))
        self.actual = (observation.prefill.serving, observation.decode.serving)
        self.series.show_actual(*self.actual)
        if self.paused:
            return None
        decision = self._decide(observation)
        if decision.action != "hold":
            decision = self._act(decision)
        self._record(decision)
        return decision

    def _decide(self, observation: Observation) -> Decision:
        at = observation.at
        held = self._hold_reason(at)
        if held is not None:
            return self._hold(at, *held)
        try:
            wanted = self.policy.decide(observation)
        except Exception as exc:
            return self._hold(at, "policy_error", f"the policy failed: {type(exc).__name__}: {exc}")
        veto = None if wanted.action == "hold" else self._veto(wanted, observation)
        if veto is None:
            return wanted
        reason, why = veto
        detail = f"{why}; the policy asked to {wanted.action} ({wanted.reason}: {wanted.detail})"
        return msgspec.structs.replace(
            wanted, action="hold", reason=reason, detail=detail, role_from=None, role_to=None
        )

    def _hold_reason(self, now: float) -> tuple[str, str] | None:
        """Why not to ask the policy at all: nothing to act on, or data too old."""
        not_ready = self.gateway.not_ready_reason()
        if not_ready is not None:
            return "not_ready", not_ready
        if self.gateway.pools is None:
            return "no_pool_control", "this deployment cannot start or stop instances"
        limit = max(self.config.interval_s, STALE_FLOOR_S)
        stale = self.observer.stale(now, limit)
        if stale:
            return "stale", f"no news from {', '.join(stale)} for over {limit:g} s"
        return None

    def _veto(self, wanted: Decision, observation: Observation) -> tuple[str, str] | None:
        if observation.operator_change:
            return "operator_change", "an operator's drain, scale or switch is under way"
        if self._moves:
            return "move_in_flight", f"waiting for {', '.join(sorted(self._moves))}"
        since = observation.at - self._last_move_at
        cooldown = self.config.cooldown_intervals * self.config.interval_s
        if since < cooldown:
            return "cooldown", f"the last move was {since:.1f} s ago (moves {cooldown:g} s apart)"
        why = self._malformed(wanted) or self._out_of_bounds(wanted)
        return None if why is None else ("out_of_bounds", why)

    def _malformed(self, wanted: Decision) -> str | None:
        if wanted.role_to not in POOLS:
            return f"{wanted.action} names no pool (role_to {wanted.role_to!r})"
        if wanted.action == "switch" and wanted.role_from not in POOLS:
            return f"switch names no pool to take from (role_from {wanted.role_from!r})"
        if wanted.action == "switch" and wanted.role_from == wanted.role_to:
            return f"switch from {wanted.role_to} to itself"
        if wanted.count < 1:
            return f"{wanted.action} of {wanted.count} instances"
        return None

    def _out_of_bounds(self, wanted: Decision) -> str | None:
        """Why the move would leave `--instance-budget` or a pool's min/max (None: it
        stays within them). Pool sizes are the pools' members, loading ones included."""
        assert self.gateway.pools is not None and wanted.role_to is not None
        sizes = {role: len(self.gateway.pools.members(role)) for role in POOLS}
        after = dict(sizes)
        moved = wanted.count if wanted.action == "switch" else 1
        after[wanted.role_to] += -1 if wanted.action == "stop" else moved
        if wanted.action == "switch" and wanted.role_from is not None:
            after[wanted.role_from] -= moved
        budget = self.config.instance_budget
        if sum(after.values()) > sum(sizes.values()) and sum(after.values()) > budget:
            return f"{sum(after.values())} instances would exceed --instance-budget {budget}"
        for role in POOLS:
            least, most = self._bounds(role)
            if after[role] < sizes[role] and after[role] < least:
                return f"{after[role]} {role} instances would fall below --min-{role} {least}"
            if after[role] > sizes[role] and after[role] > most:
                return f"{after[role]} {role} instances would exceed --max-{role} {most}"
        return None

    def _bounds(self, role: str) -> tuple[int, int]:
        c = self.config
        if role == "prefill":
            return c.min_prefill, c.max_prefill or c.instance_budget - c.min_decode
        return c.min_decode, c.max_decode or c.instance_budget - c.min_prefill

    # ---- acting -----------------------------------------------------------------------

    def _act(self, decision: Decision) -> Decision:
        """Carries the move out; a hold with reason "cannot_act" when the pools refuse."""
        try:
            instance_id = self._move(decision)
        except CannotAct as exc:
            detail = f"{exc}; the policy asked to {decision.action} ({decision.reason})"
            return msgspec.structs.replace(
                decision,
                action="hold",
                reason="cannot_act",
                detail=detail,
                role_from=None,
                role_to=None,
            )
        self._last_move_at = decision.at
        return msgspec.structs.replace(decision, detail=f"{decision.detail} [{instance_id}]")

    def _move(self, decision: Decision) -> str:
        """The instances the move changes (CannotAct: none may change now)."""
        assert self.gateway.pools is not None and decision.role_to is not None
        control, scheduler, role = self.gateway.pools, self.gateway.scheduler, decision.role_to
        if decision.action == "start":
            try:
                (instance_id,) = control.start(role, 1)
            except ValueError as exc:
                raise CannotAct(str(exc)) from None
            self._moves[instance_id] = lambda: self._registered_or_gone(instance_id, role)
            return instance_id
        if decision.action == "stop":
            view = self._least_loaded(role)
            if role == "decode" and len(scheduler.live(("decode",))) < 2:
                raise CannotAct("the last decode instance serving stays")
            self.changes.drain(view.instance_id)
            self._moves[view.instance_id] = lambda: view.instance_id not in scheduler.views
            return view.instance_id
        source = decision.role_from
        assert source is not None
        switched: list[str] = []
        for _ in range(decision.count):  # each claimed at once, so the next is another
            # A decode instance hands its running requests back to be recomputed: the one
            # holding the fewest KV blocks costs them least.
            order = _recompute_cost if source == "decode" else _load
            try:
                view = self._least_loaded(source, lambda v: self._may_switch(v, role), order)
            except CannotAct:
                if not switched:
                    raise
                break  # fewer may move now than asked: the rest wait for the next decision
            task = self.changes.switch(view, role, f"SLO controller: {decision.reason}")
            self._moves[view.instance_id] = task.done
            switched.append(view.instance_id)
        return ", ".join(switched)

    def _least_loaded(
        self,
        role: str,
        allowed: Callable[[InstanceView], str | None] | None = None,
        order: Callable[[InstanceView], tuple] | None = None,
    ) -> InstanceView:
        """The serving instance of `role` first in `order` (by default the fewest
        requests, then the least queued prefill and the most free KV blocks), among those
        no change holds and `allowed` finds no fault with (CannotAct: none)."""
        assert self.gateway.pools is not None
        why = f"no {role} instance serves"
        views = self.gateway.scheduler.live((role,))
        for view in sorted(views, key=order or _load):
            fault: str | None = f"another change of {view.instance_id} is under way"
            if not self.gateway.claims.busy(view.instance_id):
                fault = allowed(view) if allowed is not None else None
            if fault is None:
                return view
            why = fault
        raise CannotAct(why)

    def _may_switch(self, view: InstanceView, role: str) -> str | None:
        refusal = self.changes.switch_refusal(view.instance_id, role)
        return None if refusal is None else refusal.message

    def _registered_or_gone(self, instance_id: str, role: str) -> bool:
        """Whether an instance we started serves, or its start failed (no member)."""
        assert self.gateway.pools is not None
        view = self.gateway.scheduler.views.get(instance_id)
        serving = view is not None and view.alive
        return serving or instance_id not in self.gateway.pools.members(role)

    # ---- the record -------------------------------------------------------------------

    def _hold(self, at: float, reason: str, detail: str) -> Decision:
        prefill, decode = self.target or self.actual
        return Decision(at, "hold", reason, detail, prefill, decode)

    def _record(self, decision: Decision) -> None:
        self.decisions.append(decision)
        self.series.count(decision.action, decision.reason)
        self.target = (decision.target_prefill, decision.target_decode)
        self.series.show_target(*self.target)
        if decision.forecast is not None:
            self.forecast = decision.forecast
        quiet = decision.action == "hold" and decision.reason != "policy_error"
        logger.log(
            logging.INFO if quiet else logging.WARNING,
            "SLO controller: %s (%s): %s [target %d prefill + %d decode, serving %d + %d]",
            decision.action,
            decision.reason,
            decision.detail,
            decision.target_prefill,
            decision.target_decode,
            *self.actual,
        )

    def snapshot(self) -> dict[str, Any]:
        """`GET /admin/controller`'s body: its state, the latest forecast and decisions
        (`age_s`: seconds before now)."""
        now = self.clock()
        prefill, decode = self.target or (None, None)
        decisions = [
            {
                "at": d.at,
                "age_s": round(now - d.at, 3),
                "action": d.action,
                "reason": d.reason,
                "detail": d.detail,
                "target": {"prefill": d.target_prefill, "decode": d.target_decode},
                "role_from": d.role_from,
                "role_to": d.role_to,
            }
            for d in self.decisions
        ]
        return {
            "enabled": True,
            "paused": self.paused,
            "interval_s": self.config.interval_s,
            "budget": self.config.instance_budget,
            "target": {"prefill": prefill, "decode": decode},
            "actual": {"prefill": self.actual[0], "decode": self.actual[1]},
            "forecast": msgspec.to_builtins(self.forecast),
            "decisions": decisions,
        }


def _recompute_cost(view: InstanceView) -> tuple[int, int, str]:
    """The KV blocks in use first: what a switch's migrated requests compute again."""
    in_use = view.stats.num_total_blocks - view.estimated_free_blocks()
    return (in_use, len(view.in_flight), view.instance_id)


def _load(view: InstanceView) -> tuple[int, int, int, str]:
    return (
        len(view.in_flight),
        view.queued_prefill_tokens(),
        -view.estimated_free_blocks(),
        view.instance_id,
    )
