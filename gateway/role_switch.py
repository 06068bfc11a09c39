"""Carries out one role switch from the gateway's side, on its event loop.

    routing stops  →  what the instance holds ends  →  SwitchRoleTask  →  the instance's
    output in the next epoch (`InstanceOutput.switched`)  →  it serves in the new pool

Routing sends the instance nothing new (`InstanceView.draining`); a decode or colocated
instance's requests migrate to the others with their output so far (`_migrate`);
once no request needs it (`in_flight` empty: a prefill instance's requests reached
their decode instance) the instance gets the task and waits itself for what
it still holds (handed-off blocks pulled, released or out of lease;
`instance/role_switch.py`). Its output in the next epoch moves it to the other pool
(`Dispatcher._on_output` → `GlobalScheduler.switch_role`); nothing it sent in the old
epoch counts from then on. The task names the current epoch, as every task does; what
the gateway sends until the switch's output arrives names it too, and the instance
takes those until the first task in the new epoch (`instance/task_epochs.py`). Should
it die meanwhile, the switch is abandoned: the supervisor restarts it in its old pool,
as any other death.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pdserve.common.messages import AbortTask, SwitchRoleTask
from pdserve.gateway.global_scheduler import handoffs_from
from pdserve.gateway.routing import ROLES_THAT_DECODE, InstanceView

if TYPE_CHECKING:
    from pdserve.gateway.admin import PoolControl
    from pdserve.gateway.gateway import Gateway

logger = logging.getLogger(__name__)

SWITCH_POLL_S = 0.02


class RoleSwitcher:
    """Switches one instance; `run` releases its claim on it when done."""

    def __init__(self, gateway: Gateway, pools: PoolControl, view: InstanceView) -> None:
        self.gateway = gateway
        self.pools = pools
        self.view = view
        self.asked_at = time.monotonic()

    async def run(self, role: str, reason: str) -> bool:
        """True once the instance serves in `role`."""
        instance_id, old = self.view.instance_id, self.view.role
        logger.warning("%s: role switch %s → %s asked (reason: %s)", instance_id, old, role, reason)
        try:
            failure = await self._switch(role)
        finally:
            self.gateway.claims.release(instance_id)
        if failure is not None:
            logger.warning("%s: role switch %s → %s abandoned: %s", instance_id, old, role, failure)
            return False
        self.pools.move(instance_id, role)
        seconds = time.monotonic() - self.asked_at
        self.gateway.metrics.roles.record_switch(old, role, seconds)
        logger.warning(
            "%s: serves as %s after %.3f s (was %s; epoch %d; reason: %s)",
            instance_id,
            role,
            seconds,
            old,
            self.view.epoch,
            reason,
        )
        return True

    async def _switch(self, role: str) -> str | None:
        """None once switched, else why not."""
        if not self._current():
            return "it died before its switch began"
        self.gateway.scheduler.drain(self.view.instance_id)
        if self.view.role in ROLES_THAT_DECODE:
            self._migrate()
        while self._current() and self.view.in_flight:
            await asyncio.sleep(SWITCH_POLL_S)
        if not self._current():
            return "it died while its requests ended"
        epoch = self.view.epoch + 1  # the task names the current one; it switches into this
        task = SwitchRoleTask(role)
        if not self.gateway.dispatcher.send_task(self.view.instance_id, task):
            self.view.draining = False  # it serves on in its old role
            return "its task socket took no more tasks"
        while self._current() and self.view.epoch != epoch:
            await asyncio.sleep(SWITCH_POLL_S)
        return None if self._current() else "it died before it served in its new role"

    def _migrate(self) -> None:
        """The requests a decode or colocated instance runs go on elsewhere with their
        output so far (the failover's migration: the same text, seeded or greedy), so the
        switch waits for none of them to finish; one out of dispatches finishes here."""
        scheduler, dispatcher = self.gateway.scheduler, self.gateway.dispatcher
        me, most = self.view.instance_id, scheduler.config.max_attempts
        for request_id in sorted(self.view.in_flight):
            assignment = scheduler.assignments.get(request_id)
            if assignment is None or assignment.route.decode is not self.view:
                continue
            if assignment.attempts >= most:
                continue
            route = assignment.route
            for view in route.instances:  # a late handoff to this instance is void too
                abort = AbortTask([request_id], handoffs_from(route, view))
                dispatcher.send_task(view.instance_id, abort)
            dispatcher.migrate(request_id, f"{me} switches role", frozenset({me}))

    def _current(self) -> bool:
        """Whether the instance still lives the life the switch began in (a death
        retires it; a restart registers a view of its own)."""
        views = self.gateway.scheduler.views
        return self.view.alive and views.get(self.view.instance_id) is self.view
