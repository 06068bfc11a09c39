"""Operator routes behind the admin key: drain an instance, scale a pool, read a request's
timeline.

- `POST /admin/instances/{id}/drain`: routing sends it nothing new, it is never
  restarted, the requests it has finish, then it is stopped and leaves `/health`.
- `POST /admin/pools/{role}/scale` `{"size": N}`: answers 202 at once with the target;
  more instances start (a few at a time, on the cluster's threads) and join their pool
  once loaded, or the newest drain as above. A size over the pool's `--max-pool-size`
  is a 400.

- `GET /admin/requests/{id}/timeline`: a recent request's phases on the gateway's clock
  (`gateway/timelines.py`), by its response id or a choice's; 404 once it aged out.

Neither drain nor scale drops or fails a request. Starting and stopping processes is the cluster's
(`Gateway.pools`, a `PoolControl` that `pdserve serve` sets); without one these routes
answer 501. The gateway only stops routing to a draining instance and waits for it to
empty.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from pdserve.gateway.errors import APIError
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.routing import ROLES_THAT_DECODE

DRAIN_POLL_S = 0.2


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


class ScaleBody(msgspec.Struct, forbid_unknown_fields=True):
    size: int


def admin_router(gateway: Gateway) -> APIRouter:
    router = APIRouter(prefix="/admin")
    draining: set[asyncio.Task] = set()  # held so the loop does not drop them

    def pools() -> PoolControl:
        if gateway.pools is None:
            raise APIError(
                501, "this deployment cannot start or stop instances", code="unsupported"
            )
        return gateway.pools

    def drain(instance_id: str) -> None:
        control = pools()
        view = gateway.scheduler.views.get(instance_id)
        control.retire(instance_id)
        if view is None or not view.alive:
            control.stop(instance_id)  # still loading, or dead: nothing to wait for
            return
        gateway.scheduler.drain(instance_id)
        task = asyncio.get_running_loop().create_task(_stop_when_empty(gateway, instance_id))
        draining.add(task)
        task.add_done_callback(draining.discard)

    @router.post("/instances/{instance_id}/drain")
    async def drain_instance(instance_id: str) -> Response:
        if instance_id not in pools().members(_role_of(gateway, instance_id)):
            raise APIError(404, f"no instance {instance_id} to drain", code="not_found")
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
        least = 1 if role in ROLES_THAT_DECODE else 0
        if size < least:
            raise APIError(400, f"a {role} pool needs at least {least} instance(s)", "size")
        most = pools().max_size(role)
        if most is not None and size > most:
            raise APIError(
                400, f"a {role} pool may hold at most {most} instances (--max-pool-size)", "size"
            )
        started, drained = [], members[size:][::-1]  # the newest go first
        if size > len(members):
            try:
                started = pools().start(role, size - len(members))
            except ValueError as exc:
                raise APIError(501, str(exc), code="unsupported") from None
        for instance_id in drained:
            drain(instance_id)
        body = {"role": role, "size": size, "starting": started, "draining": drained}
        return gateway.json(body, status=202)

    @router.get("/requests/{request_id}/timeline")
    async def request_timeline(request_id: str) -> Response:
        run = gateway.dispatcher.timelines.get(request_id)
        if run is None:
            raise APIError(
                404, f"no recent request {request_id} (only the latest are kept)", "id", "not_found"
            )
        return gateway.json(msgspec.to_builtins(run))

    return router


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
