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

- `GET /admin/controller`, `POST /admin/controller` `{"paused": true}`: the SLO
  controller (`gateway/controller_routes.py`).

- `GET /admin/requests/{id}/timeline`: a recent request's phases on the gateway's clock
  (`gateway/timelines.py`), by its response id or a choice's; 404 once it aged out.

None drops nor fails a request. Starting and stopping processes is the cluster's
(`Gateway.pools`, a `PoolControl` that `pdserve serve` sets); without one these routes
answer 501. The gateway only stops routing to a draining instance and waits for it to
empty.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from pdserve.gateway.controller_routes import add_controller_routes
from pdserve.gateway.errors import APIError
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.pool_changes import InstanceClaims, PoolChanges
from pdserve.gateway.routing import ROLES_THAT_DECODE

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
    changes = PoolChanges(gateway)  # the same drains and switches the SLO controller makes

    def pools() -> PoolControl:
        if gateway.pools is None:
            raise APIError(
                501, "this deployment cannot start or stop instances", code="unsupported"
            )
        return gateway.pools

    @router.post("/instances/{instance_id}/drain")
    async def drain_instance(instance_id: str) -> Response:
        if instance_id not in pools().members(changes.role_of(instance_id)):
            raise APIError(404, f"no instance {instance_id} to drain", code="not_found")
        _refuse_busy(gateway.claims, [instance_id])
        changes.drain(instance_id)
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
        _refuse_busy(gateway.claims, drained)
        if size > len(members):
            try:
                started = pools().start(role, size - len(members))
            except ValueError as exc:
                raise APIError(501, str(exc), code="unsupported") from None
        for instance_id in drained:
            changes.drain(instance_id)
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
        pools()
        refusal = changes.switch_refusal(instance_id, body.role)
        if refusal is not None:
            code = "not_found" if refusal.status == 404 else "conflict"
            raise APIError(refusal.status, refusal.message, refusal.param, code)
        view = gateway.scheduler.views[instance_id]
        answer = {"id": instance_id, "from": view.role, "to": body.role, "switching": True}
        changes.switch(view, body.role, body.reason)
        return gateway.json(answer, status=202)

    add_controller_routes(router, gateway)
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


def _refuse_busy(claims: InstanceClaims, instance_ids: list[str]) -> None:
    for instance_id in instance_ids:
        if claims.busy(instance_id):
            message = f"another change of {instance_id} is under way"
            raise APIError(409, message, code="conflict")
