"""Test hooks: the /debug/* routes, mounted only with `pdserve serve --enable-test-hooks`.

Without the flag they do not exist (404 like any unknown path): a production gateway
shows no instance's books and lets nobody switch policies or leak blocks.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from pdserve.common.messages import FailStepsTask, LeakBlocksTask
from pdserve.gateway.errors import APIError
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.routing import make_policy


def debug_router(gateway: Gateway) -> APIRouter:
    router = APIRouter(prefix="/debug")

    @router.get("/instances")
    async def instances() -> Response:
        """Each live instance's books: invariant check, block owners, unfinished requests."""
        inspections = await gateway.dispatcher.inspect()
        found = {}
        for instance_id, view in gateway.scheduler.views.items():
            inspection = inspections.get(instance_id)
            found[instance_id] = {
                "role": view.role,
                "pid": view.info.pid,
                "alive": view.alive,
                "epoch": view.epoch,
                "in_flight": sorted(view.in_flight),
                "inspection": None if inspection is None else msgspec.to_builtins(inspection),
            }
        return gateway.json({"instances": found})

    @router.post("/routing-policy")
    async def set_routing_policy(name: str) -> Response:
        """Switches the global scheduler's policy without a restart (tests run one pool
        under every policy)."""
        try:
            gateway.scheduler.policy = make_policy(name)
        except ValueError as exc:
            raise APIError(400, str(exc), "name") from None
        return gateway.json({"routing_policy": name})

    @router.post("/instances/{instance_id}/leak")
    async def leak(instance_id: str, blocks: int = 1) -> Response:
        """Holds blocks on an instance for a request nobody knows, so tests can prove the
        invariant check catches a leak."""
        if not 1 <= blocks <= 1024 or not gateway.dispatcher.send_task(
            instance_id, LeakBlocksTask(blocks)
        ):
            raise APIError(400, f"cannot leak {blocks} blocks on {instance_id!r}")
        return gateway.json({"leaked": blocks, "instance": instance_id})

    @router.post("/instances/{instance_id}/fail-steps")
    async def fail_steps(instance_id: str, request: Request) -> Response:
        """From now on every step of the instance fails (`{"every_step": true}`), or
        every step while a request whose prompt starts with `prompt_prefix` is there;
        `{}` turns it off (the chaos suite's breaker and probation rows)."""
        try:
            task = msgspec.json.decode(await request.body(), type=FailStepsBody)
        except msgspec.DecodeError as exc:
            raise APIError(400, f"the body: {exc}", "every_step") from None
        rule = FailStepsTask(task.every_step, task.prompt_prefix)
        if not gateway.dispatcher.send_task(instance_id, rule):
            raise APIError(404, f"no instance {instance_id!r}", code="not_found")
        return gateway.json({"instance": instance_id, **msgspec.to_builtins(rule)})

    return router


class FailStepsBody(msgspec.Struct, forbid_unknown_fields=True):
    every_step: bool = False
    prompt_prefix: list[int] = []
