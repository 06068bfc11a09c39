"""The changes of an instance both the admin routes and the SLO controller make: drain
it for good, or switch its role; each holds its claim on the instance until it ends.

The gateway's `InstanceClaims` let one change of an instance run at a time. A drain
claims the instance for good (it stops), retires it (never restarted), takes it out of
routing and stops it once no request needs it. A switch claims it and runs a
`RoleSwitcher`, which releases the claim when the instance serves in its new role or the
switch is abandoned. `switch_refusal` says why an instance may not switch now, in the
words the admin route answers with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pdserve.gateway.role_switch import RoleSwitcher
from pdserve.gateway.routing import ROLES_THAT_DECODE, InstanceView

if TYPE_CHECKING:
    from pdserve.gateway.admin import PoolControl
    from pdserve.gateway.gateway import Gateway

DRAIN_POLL_S = 0.2
T = TypeVar("T")


class InstanceClaims:
    """The instances a drain or a switch holds: one change of an instance at a time. The
    event loop's thread only."""

    def __init__(self) -> None:
        self._held: set[str] = set()

    def claim(self, instance_id: str) -> bool:
        """Starts a change of the instance: False while another runs."""
        if instance_id in self._held:
            return False
        self._held.add(instance_id)
        return True

    def busy(self, instance_id: str) -> bool:
        """Whether a change of the instance runs."""
        return instance_id in self._held

    def release(self, instance_id: str) -> None:
        """The change of the instance ended."""
        self._held.discard(instance_id)


@dataclass(frozen=True)
class Refusal:
    """Why a change cannot run now: the HTTP status the admin route answers with."""

    status: int  # 404: no such member; 409: not now
    message: str
    param: str | None = None


class PoolChanges:
    """Starts drains and switches on the running loop and keeps their tasks alive."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._tasks: set[asyncio.Task[Any]] = set()

    def control(self) -> PoolControl:
        """The cluster's pool control (callers check `gateway.pools` first)."""
        assert self.gateway.pools is not None
        return self.gateway.pools

    def drain(self, instance_id: str) -> asyncio.Task[None] | None:
        """Drains the instance for good; the task ends once it is stopped (None: it was
        loading or dead, and is stopped at once)."""
        control = self.control()
        self.gateway.claims.claim(instance_id)  # for good: it stops
        view = self.gateway.scheduler.views.get(instance_id)
        control.retire(instance_id)
        if view is None or not view.alive:
            control.stop(instance_id)  # still loading, or dead: nothing to wait for
            return None
        self.gateway.scheduler.drain(instance_id)
        return self._keep(self._stop_when_empty(instance_id))

    def switch(self, view: InstanceView, role: str, reason: str) -> asyncio.Task[bool]:
        """Claims the instance and switches it to `role` (check `switch_refusal` first);
        the task answers whether it serves in `role`."""
        self.gateway.claims.claim(view.instance_id)
        return self._keep(RoleSwitcher(self.gateway, self.control(), view).run(role, reason))

    def switch_refusal(self, instance_id: str, role: str) -> Refusal | None:
        """Why the instance may not switch to `role` now (None: it may)."""
        control = self.control()
        if instance_id not in control.members(self.role_of(instance_id)):
            return Refusal(404, f"no instance {instance_id} to switch")
        if self.gateway.claims.busy(instance_id):
            return Refusal(409, f"another change of {instance_id} is under way")
        view = self.gateway.scheduler.views.get(instance_id)
        if view is None or not view.alive or view.draining:
            return Refusal(
                409, f"{instance_id} is not serving now (loading, restarting or draining)"
            )
        if view.role == role:
            return Refusal(409, f"{instance_id} is {role} already", "role")
        why = self._floor(instance_id, role) or control.fit(instance_id, role)
        return None if why is None else Refusal(409, why, "role")

    def role_of(self, instance_id: str) -> str:
        view = self.gateway.scheduler.views.get(instance_id)
        if view is not None:
            return view.role
        return instance_id.rsplit("-", 1)[0]  # still loading: ids are "<role>-<n>"

    def _floor(self, instance_id: str, role: str) -> str | None:
        """Why the switch would leave no instance that decodes (None: others do)."""
        if role in ROLES_THAT_DECODE:
            return None
        live = self.gateway.scheduler.live(ROLES_THAT_DECODE)
        if [v for v in live if v.instance_id != instance_id]:
            return None
        return f"{instance_id} is the last decode or colocated instance serving: it must stay one"

    def _keep(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)
        return task

    async def _stop_when_empty(self, instance_id: str) -> None:
        """Stops a draining instance once no request needs it (one that dies meanwhile
        has its requests migrated as any other, and is not restarted)."""
        while True:
            view = self.gateway.scheduler.views.get(instance_id)
            if view is None or not view.alive:
                return
            if not view.in_flight:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        self.control().stop(instance_id)
