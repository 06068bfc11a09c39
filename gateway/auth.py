"""Who may call what: FastAPI dependencies over the gateway's `KeyBook`.

- `require_tenant`: the API routes. With tenant keys configured, `Authorization: Bearer`
  must carry one (401 otherwise); the tenant lands in `request.state.tenant`. Without
  any, every client is the anonymous `default` tenant.
- `require_admin`: operator endpoints (`/admin/*`, and `/debug/*` with test hooks). Only
  the admin key opens them, never a tenant's key (403); with no key configured at all
  they are as open as everything else.
- `require_metrics_reader`: `/metrics`, for any tenant's key or the admin key, unless
  `--metrics-public` (a scraper inside a trusted network) or no key is configured.
"""

from __future__ import annotations

from starlette.requests import Request

from pdserve.gateway.errors import APIError
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.tenants import ANONYMOUS, Tenant


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _unauthorized() -> APIError:
    # The same answer for a missing, malformed or wrong key: nothing to probe.
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def require_tenant(request: Request) -> None:
    keys = _gateway(request).keys
    if not keys.tenant_keys:
        request.state.tenant = ANONYMOUS
        return
    token = bearer_token(request)
    tenant = keys.tenant_for(token) if token is not None else None
    if tenant is None:
        raise _unauthorized()
    request.state.tenant = tenant


def require_admin(request: Request) -> None:
    keys = _gateway(request).keys
    if not keys.any_keys:
        return
    token = bearer_token(request)
    if token is not None and keys.is_admin(token):
        return
    if token is not None and keys.tenant_for(token) is not None:
        raise APIError(403, "this endpoint needs the admin key (--admin-api-key)", code="forbidden")
    raise _unauthorized()


def require_metrics_reader(request: Request) -> None:
    gateway = _gateway(request)
    keys = gateway.keys
    if gateway.config.metrics_public or not keys.any_keys:
        return
    token = bearer_token(request)
    if token is None or (not keys.is_admin(token) and keys.tenant_for(token) is None):
        raise _unauthorized()


def tenant_of(request: Request) -> Tenant:
    """The tenant `require_tenant` found (ANONYMOUS on a route it does not guard)."""
    return getattr(request.state, "tenant", ANONYMOUS)
