"""The FastAPI app: routes, who may call them (`auth.py`), and errors always in OpenAI's
shape."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from pdserve.gateway.admin import admin_router
from pdserve.gateway.auth import (
    require_admin,
    require_metrics_reader,
    require_tenant,
    tenant_of,
)
from pdserve.gateway.chat import create_chat_completion
from pdserve.gateway.completions import create_completion
from pdserve.gateway.debug import debug_router
from pdserve.gateway.errors import APIError
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.openapi import openapi_document
from pdserve.gateway.responses_api import create_response
from pdserve.gateway.tokenization import detokenize, tokenize

logger = logging.getLogger(__name__)
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Handler = Callable[[Request, Gateway], Awaitable[Response]]


async def health(request: Request, gateway: Gateway) -> Response:
    """200 while a request can be served, 503 with Retry-After while none can (starting,
    or no decode or colocated instance alive), as vLLM's and SGLang's /health: what load
    balancers and probes read. The body says more: `status` is "ok", or "degraded" when
    the service serves worse than it should, each reason a line in `warnings` naming the
    instance (a decode instance that recomputed at least half of its latest handoffs
    because their KV pulls failed: each of those prompts was computed twice); `instances`
    lists every instance, a decode instance with its `kv_pulls` (recent, recomputed,
    recomputing, last_failure)."""
    gateway.require_ready()
    return gateway.json(gateway.health())


OPENAPI = openapi_document()  # built once: it depends on the request types only


async def metrics(request: Request, gateway: Gateway) -> Response:
    return Response(gateway.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)


async def models(request: Request, gateway: Gateway) -> Response:
    gateway.require_ready()  # as /health: clients poll /v1/models to wait for a server
    card = gateway.model_card
    data = [
        {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pdserve",
            "root": gateway.config.model_path,
            "parent": None,
            "max_model_len": card.max_model_len if card else None,
        }
        for name in gateway.models_of(tenant_of(request))
    ]
    return gateway.json({"object": "list", "data": data})


async def openapi(request: Request, gateway: Gateway) -> Response:
    return gateway.json(OPENAPI)


OPEN_ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/health", health),
    ("GET", "/openapi.json", openapi),
]
# Behind a tenant's key or the admin key, unless --metrics-public.
METRICS_ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/metrics", metrics),
]
# Behind a tenant's key, when there are any.
PROTECTED_ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/v1/models", models),
    ("POST", "/v1/completions", create_completion),
    ("POST", "/v1/chat/completions", create_chat_completion),
    ("POST", "/v1/responses", create_response),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
]


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    _add_error_handlers(app)
    _add_routes(app, gateway, OPEN_ROUTES)
    _add_routes(app, gateway, METRICS_ROUTES, [Depends(require_metrics_reader)])
    _add_routes(app, gateway, PROTECTED_ROUTES, [Depends(require_tenant)])
    app.include_router(admin_router(gateway), dependencies=[Depends(require_admin)])
    if gateway.config.enable_test_hooks:  # operator endpoints: the admin key only
        app.include_router(debug_router(gateway), dependencies=[Depends(require_admin)])
    return app


def _add_routes(
    app: FastAPI,
    gateway: Gateway,
    routes: list[tuple[str, str, Handler]],
    dependencies: list[Any] | None = None,
) -> None:
    for method, path, handler in routes:
        endpoint = _endpoint(handler, gateway)
        app.add_api_route(path, endpoint, methods=[method], dependencies=dependencies)


def _endpoint(handler: Handler, gateway: Gateway) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        request.state.received_at = time.time()  # where a generation's timeline starts
        return await handler(request, gateway)

    return endpoint


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"invalid request: {where}: {first.get('msg', 'invalid')}"
        return APIError(400, message).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
