"""Operator routes behind the admin key: drain an instance, scale a pool, switch roles,
read a request's timeline.

- `POST /admin/instances/{id}/drain`: routing sends it nothing new, it is never
  restarted, the requests it has finish, then it is stopped and leaves `/health`.
- `POST /admin/pools/{role}/scale` `{"size": N}`: answers 202 at once with the target;
  more instances start (a few at a time, on the cluster's threads) and join their pool
  once loaded, or the newest drain as above. A size over the pool's `--max-pool-size`
  is a 400.
- `POST /admin/instances/{id}/role` `{"role": "decode", "reason": "..."}`: answers 202
  at once; the instance leaves its pool for the other (a decoding one's streams
  migrate to the others) without reloading its weights or restarting its process
  (`gateway/role_switch.py`), under the same id, in the next epoch. A 409 names why
  not: a configuration unlike the pool's, the pool at its `--max-pool-size`, no
  decode or colocated instance left, another change of the instance (switch or
  drain) under way, or the role it has.

- `GET /admin/requests/{id}/timeline`: a recent request's phases on the gateway's clock
  (`gateway/timelines.py`), by its response id or a choice's; 404 once it aged out.

None drops nor fails a request. Starting and stopping processes is the cluster's
(`Gateway.pools`, a `PoolControl` that `pdserve serve` sets); without one these routes
answer 501. The gateway only stops routing to a draining instance and waits for it to
empty.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from pdserve.gateway.errors import APIError
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.role_switch import RoleSwitcher
from pdserve.gateway.routing import ROLES_THAT_DECODE, InstanceView

DRAIN_POLL_S = 0.2
ROLES = ("prefill", "decode", "colocated")


class PoolControl(Protocol):
    """What the cluster does for these routes (`cluster/pools.py`)."""

    def members(self, role: str) -> list[str]:
        """The pool's instances (loaded or loading, not draining), oldest first."""
        ...

    def max_size(self, role: str) -> int | None:
        """The most instances the pool may hold (None: no limit)."""
        ...

    def start(self, role: str, count: int) -> list[str]:
        """The ids of `count` more instances of the pool, which start in the background;
        returns at once (ValueError: cannot)."""
        ...

    def retire(self, instance_id: str) -> None:
        """Never restarts the instance again."""
        ...

    def stop(self, instance_id: str) -> None:
        """Stops its process (it leaves the gateway's books when its exit is seen)."""
        ...

    def fit(self, instance_id: str, role: str) -> str | None:
        """Why the instance cannot join `role`'s pool (None: it can)."""
        ...

    def claim(self, instance_id: str) -> bool:
        """Starts a change of the instance (drain, switch): False while one runs."""
        ...

    def busy(self, instance_id: str) -> bool:
        """Whether a change of the instance runs."""
        ...

    def release(self, instance_id: str) -> None:
        """The change of the instance ended."""
        ...

    def move(self, instance_id: str, role: str) -> None:
        """The instance belongs to `role`'s pool now (restarts start it there)."""
        ...


class ScaleBody(msgspec.Struct, forbid_unknown_fields=True):
    size: int


class RoleBody(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    reason: str = "operator request"  # written to the gateway's log with the switch


def admin_router(gateway: Gateway) -> APIRouter:
    router = APIRouter(prefix="/admin")
    changing: set[asyncio.Task] = set()  # drains and switches, held so the loop keeps them

    def pools() -> PoolControl:
        if gateway.pools is None:
            raise APIError(
                501, "this deployment cannot start or stop instances", code="unsupported"
            )
        return gateway.pools

    def keep(coroutine: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        changing.add(task)
        task.add_done_callback(changing.discard)

    def drain(instance_id: str) -> None:
        control = pools()
        control.claim(instance_id)  # for good: it stops
        view = gateway.scheduler.views.get(instance_id)
        control.retire(instance_id)
        if view is None or not view.alive:
            control.stop(instance_id)  # still loading, or dead: nothing to wait for
            return
        gateway.scheduler.drain(instance_id)
        keep(_stop_when_empty(gateway, instance_id))

    @router.post("/instances/{instance_id}/drain")
    async def drain_instance(instance_id: str) -> Response:
        if instance_id not in pools().members(_role_of(gateway, instance_id)):
            raise APIError(404, f"no instance {instance_id} to drain", code="not_found")
        _refuse_busy(pools(), [instance_id])
        drain(instance_id)
        return gateway.json({"id": instance_id, "draining": True})

    @router.post("/pools/{role}/scale")
    async def scale_pool(role: str, request: Request) -> Response:
        try:
            size = msgspec.json.decode(await request.body(), type=ScaleBody).size
        except msgspec.DecodeError as exc:
            raise APIError(400, f'the body must be {{"size": N}}: {exc}', "size") from None
        members = pools().members(role)
        if not members:
            raise APIError(404, f"this deployment has no {role} pool", "role", "not_found")
        _check_size(pools(), role, size)
        started, drained = [], members[size:][::-1]  # the newest go first
        _refuse_busy(pools(), drained)
        if size > len(members):
            try:
                started = pools().start(role, size - len(members))
            except ValueError as exc:
                raise APIError(501, str(exc), code="unsupported") from None
        for instance_id in drained:
            drain(instance_id)
        body = {"role": role, "size": size, "starting": started, "draining": drained}
        return gateway.json(body, status=202)

    @router.post("/instances/{instance_id}/role")
    async def switch_role(instance_id: str, request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=RoleBody)
        except msgspec.DecodeError as exc:
            raise APIError(400, f'the body must be {{"role": ROLE}}: {exc}', "role") from None
        if body.role not in ROLES:
            raise APIError(400, f"role must be one of {', '.join(ROLES)}", "role")
        control = pools()
        view = _switchable(gateway, control, instance_id, body.role)
        control.claim(instance_id)
        answer = {"id": instance_id, "from": view.role, "to": body.role, "switching": True}
        keep(RoleSwitcher(gateway, control, view).run(body.role, body.reason))
        return gateway.json(answer, status=202)

    _add_timeline_route(router, gateway)
    return router


def _add_timeline_route(router: APIRouter, gateway: Gateway) -> None:
    @router.get("/requests/{request_id}/timeline")
    async def request_timeline(request_id: str) -> Response:
        run = gateway.dispatcher.timelines.get(request_id)
        if run is None:
            raise APIError(
                404, f"no recent request {request_id} (only the latest are kept)", "id", "not_found"
            )
        return gateway.json(msgspec.to_builtins(run))


def _check_size(control: PoolControl, role: str, size: int) -> None:
    """A 400 for a size the pool may not have: below its floor or over `--max-pool-size`."""
    least = 1 if role in ROLES_THAT_DECODE else 0
    if size < least:
        raise APIError(400, f"a {role} pool needs at least {least} instance(s)", "size")
    most = control.max_size(role)
    if most is not None and size > most:
        raise APIError(
            400, f"a {role} pool may hold at most {most} instances (--max-pool-size)", "size"
        )


def _refuse_busy(control: PoolControl, instance_ids: list[str]) -> None:
    for instance_id in instance_ids:
        if control.busy(instance_id):
            message = f"another change of {instance_id} is under way"
            raise APIError(409, message, code="conflict")


def _switchable(
    gateway: Gateway, control: PoolControl, instance_id: str, role: str
) -> InstanceView:
    """The instance's view if it may switch to `role` now; else the 404 or 409 saying
    why not."""
    if instance_id not in control.members(_role_of(gateway, instance_id)):
        raise APIError(404, f"no instance {instance_id} to switch", code="not_found")
    _refuse_busy(control, [instance_id])
    view = gateway.scheduler.views.get(instance_id)
    if view is None or not view.alive or view.draining:
        message = f"{instance_id} is not serving now (loading, restarting or draining)"
        raise APIError(409, message, code="conflict")
    if view.role == role:
        raise APIError(409, f"{instance_id} is {role} already", "role", "conflict")
    why = _floor(gateway, instance_id, role) or control.fit(instance_id, role)
    if why is not None:
        raise APIError(409, why, "role", "conflict")
    return view


def _floor(gateway: Gateway, instance_id: str, role: str) -> str | None:
    """Why the switch would leave no instance that decodes (None: others do)."""
    if role in ROLES_THAT_DECODE:
        return None
    others = [v for v in gateway.scheduler.live(ROLES_THAT_DECODE) if v.instance_id != instance_id]
    if others:
        return None
    return f"{instance_id} is the last decode or colocated instance serving: it must stay one"


def _role_of(gateway: Gateway, instance_id: str) -> str:
    view = gateway.scheduler.views.get(instance_id)
    if view is not None:
        return view.role
    return instance_id.rsplit("-", 1)[0]  # still loading: ids are "<role>-<n>"


async def _stop_when_empty(gateway: Gateway, instance_id: str) -> None:
    """Stops a draining instance once no request needs it (one that dies meanwhile has
    its requests migrated as any other, and is not restarted)."""
    while True:
        view = gateway.scheduler.views.get(instance_id)
        if view is None or not view.alive:
            return
        if not view.in_flight:
            break
        await asyncio.sleep(DRAIN_POLL_S)
    assert gateway.pools is not None
    gateway.pools.stop(instance_id)
