"""`/admin/controller`: the SLO controller as operators see and pause it.

- `GET /admin/controller`: `{"enabled", "paused", "interval_s", "budget", "target",
  "actual", "forecast", "decisions"}` (the latest decisions, oldest first, each with
  `at`, `age_s`, `action`, `reason`, `detail`); with `--autoscale off` only `"enabled":
  false` says anything.
- `POST /admin/controller` `{"paused": true}`: the controller observes on and decides
  nothing until `{"paused": false}`; a 409 with `--autoscale off`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from pdserve.gateway.errors import APIError

if TYPE_CHECKING:
    from pdserve.gateway.gateway import Gateway

OFF: dict[str, Any] = {
    "enabled": False,
    "paused": False,
    "interval_s": None,
    "budget": None,
    "target": None,
    "actual": None,
    "forecast": None,
    "decisions": [],
}


class PauseBody(msgspec.Struct, forbid_unknown_fields=True):
    paused: bool


def add_controller_routes(router: APIRouter, gateway: Gateway) -> None:
    @router.get("/controller")
    async def controller_state() -> Response:
        controller = gateway.controller
        return gateway.json(OFF if controller is None else controller.snapshot())

    @router.post("/controller")
    async def pause_controller(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=PauseBody)
        except msgspec.DecodeError as exc:
            raise APIError(400, f'the body must be {{"paused": BOOL}}: {exc}', "paused") from None
        controller = gateway.controller
        if controller is None:
            message = "the SLO controller is off (pdserve serve --autoscale slo turns it on)"
            raise APIError(409, message, code="conflict")
        controller.pause(body.paused)
        return gateway.json(controller.snapshot())
