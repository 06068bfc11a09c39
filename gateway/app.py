"""The FastAPI app: routes, API-key check, and errors always in OpenAI's shape."""

from __future__ import annotations

import hmac
import logging
import time

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from pdserve.gateway.chat import create_chat_completion
from pdserve.gateway.completions import create_completion
from pdserve.gateway.errors import APIError, error_response
from pdserve.gateway.state import Gateway
from pdserve.gateway.tokenization import detokenize, tokenize
from pdserve.scheduler.routing import make_policy

logger = logging.getLogger(__name__)
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def require_api_key(request: Request) -> None:
    key = gateway_of(request).config.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    _add_error_handlers(app)
    protected = [Depends(require_api_key)]

    @app.get("/health")
    async def health() -> Response:
        if gateway.ready():
            return gateway.json({"status": "ok", "instances": gateway.instance_health()})
        return error_response(503, "no instance is ready", code="unavailable")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models", dependencies=protected)
    async def models() -> Response:
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
            for name in gateway.config.served_model_names
        ]
        return gateway.json({"object": "list", "data": data})

    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request) -> Response:
        return await create_completion(request, gateway)

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, gateway)

    @app.post("/tokenize", dependencies=protected)
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(request, gateway)

    @app.post("/detokenize", dependencies=protected)
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(request, gateway)

    @app.get("/debug/instances", dependencies=protected)
    async def debug_instances() -> Response:
        """Each live instance's books: invariant check, block owners, unfinished requests."""
        inspections = await gateway.dispatcher.inspect()
        instances = {}
        for instance_id, view in gateway.scheduler.views.items():
            found = inspections.get(instance_id)
            instances[instance_id] = {
                "role": view.role,
                "pid": view.info.pid,
                "alive": view.alive,
                "in_flight": sorted(view.in_flight),
                "inspection": None if found is None else msgspec.to_builtins(found),
            }
        return gateway.json({"instances": instances})

    @app.post("/debug/routing-policy", dependencies=protected)
    async def set_routing_policy(name: str) -> Response:
        """Test hook: switch the global scheduler's policy without a restart (tests run
        one pool under every policy)."""
        if not gateway.config.enable_test_hooks:
            raise APIError(404, "test hooks are off (start with --enable-test-hooks)")
        try:
            gateway.scheduler.policy = make_policy(name)
        except ValueError as exc:
            raise APIError(400, str(exc), "name") from None
        return gateway.json({"routing_policy": name})

    @app.post("/debug/instances/{instance_id}/leak", dependencies=protected)
    async def leak(instance_id: str, blocks: int = 1) -> Response:
        if not gateway.config.enable_test_hooks:
            raise APIError(404, "test hooks are off (start with --enable-test-hooks)")
        if not 1 <= blocks <= 1024 or not gateway.dispatcher.leak_blocks(instance_id, blocks):
            raise APIError(400, f"cannot leak {blocks} blocks on {instance_id!r}")
        return gateway.json({"leaked": blocks, "instance": instance_id})

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(400, f"invalid request: {where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}")
