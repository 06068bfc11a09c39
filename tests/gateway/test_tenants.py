"""Tenants and keys at the gateway (docs/security.md): a key is needed
whenever keys are configured (401 in OpenAI's shape otherwise), a tenant sees only its
models, no tenant key opens the operator endpoints, /metrics needs a key unless
public, every request's cache salt is bound to its tenant, and no key is ever logged."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdserve.common.wire_auth import salt_key
from pdserve.gateway.tenants import TenantEntry, tenant_cache_salt
from tests.gateway.tenant_fakes import ADMIN, completion, key, keys_file, tenant_gateway

ALICE = TenantEntry("alice", ["alice-key-1", "alice-key-2"])
BOB = TenantEntry("bob", ["bob-key"], models=["m-large"])
KEYS = keys_file(ALICE, BOB)


def run(coroutine):
    return asyncio.run(coroutine)


def assert_unauthorized(response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")


def test_a_key_is_needed_and_a_wrong_one_is_refused() -> None:
    async def scenario() -> None:
        async with tenant_gateway(api_keys=KEYS, admin_api_key=ADMIN) as (_, instance, client):
            wrong = ({}, key("wrong"), key("alice-key-1x"), key(ADMIN))
            for headers in (*wrong, {"Authorization": "Basic alice-key-1"}):
                assert_unauthorized(
                    await client.post("/v1/completions", json=completion(), headers=headers)
                )
                assert_unauthorized(await client.get("/v1/models", headers=headers))
            assert instance.tasks == []
            for alice in ("alice-key-1", "alice-key-2"):
                response = await client.post(
                    "/v1/completions", json=completion(), headers=key(alice)
                )
                assert response.status_code == 200, response.text
            assert (await client.get("/health")).status_code == 200  # health stays open

    run(scenario())


def test_the_single_api_key_is_the_default_tenant() -> None:
    async def scenario() -> None:
        async with tenant_gateway(api_key="only-key") as (gateway, _, client):
            assert_unauthorized(await client.get("/v1/models"))
            assert (await client.get("/v1/models", headers=key("only-key"))).status_code == 200
            assert [t.name for t in gateway.keys.tenants] == ["default"]

    run(scenario())


def test_a_tenant_sees_and_uses_only_its_models() -> None:
    async def scenario() -> None:
        async with tenant_gateway(api_keys=KEYS) as (_, instance, client):
            models = await client.get("/v1/models", headers=key("bob-key"))
            assert [m["id"] for m in models.json()["data"]] == ["m-large"]
            refused = await client.post(
                "/v1/completions", json=completion(model="m"), headers=key("bob-key")
            )
            assert (
                refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
            )
            chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            assert (
                await client.post("/v1/chat/completions", json=chat, headers=key("bob-key"))
            ).status_code == 404
            default = await client.post(
                "/v1/completions", json=completion(), headers=key("bob-key")
            )
            assert default.status_code == 200 and default.json()["model"] == "m-large"
            assert len(instance.tasks) == 1
            mine = await client.get("/v1/models", headers=key("alice-key-1"))
            assert [m["id"] for m in mine.json()["data"]] == ["m", "m-large"]

    run(scenario())


def test_operator_endpoints_open_only_to_the_admin_key() -> None:
    debug = "/debug/routing-policy?name=round_robin"  # answers at once (no instance asked)

    async def scenario() -> None:
        config = {"api_keys": KEYS, "admin_api_key": ADMIN, "enable_test_hooks": True}
        async with tenant_gateway(**config) as (_, _, client):
            assert_unauthorized(await client.post(debug))
            assert_unauthorized(await client.post(debug, headers=key("wrong")))
            tenant = await client.post(debug, headers=key("alice-key-1"))
            assert tenant.status_code == 403 and "admin" in tenant.json()["error"]["message"]
            assert (await client.post(debug, headers=key(ADMIN))).status_code == 200
        async with tenant_gateway(api_keys=KEYS, enable_test_hooks=True) as (_, _, client):
            # No admin key configured: nobody opens them, a tenant's key included.
            assert (await client.post(debug, headers=key("alice-key-1"))).status_code == 403
            assert_unauthorized(await client.post(debug))


def test_metrics_need_a_key_unless_public() -> None:
    async def scenario() -> None:
        async with tenant_gateway(api_keys=KEYS, admin_api_key=ADMIN) as (_, _, client):
            assert_unauthorized(await client.get("/metrics"))
            assert_unauthorized(await client.get("/metrics", headers=key("wrong")))
            for good in ("bob-key", ADMIN):
                assert (await client.get("/metrics", headers=key(good))).status_code == 200
        async with tenant_gateway(api_keys=KEYS, metrics_public=True) as (_, _, client):
            assert (await client.get("/metrics")).status_code == 200

    run(scenario())


def test_per_tenant_series_are_labelled_by_name_only() -> None:
    async def scenario() -> str:
        async with tenant_gateway(api_keys=KEYS) as (_, instance, client):
            instance.tokens = 3
            for _ in range(2):
                await client.post("/v1/completions", json=completion(), headers=key("alice-key-1"))
            return (await client.get("/metrics", headers=key("alice-key-1"))).text

    text = run(scenario())
    assert 'pdserve:tenant_requests_total{tenant="alice"} 2.0' in text
    assert 'pdserve:tenant_generation_tokens_total{tenant="alice"} 6.0' in text
    assert 'pdserve:tenant_requests_total{tenant="bob"} 0.0' in text
    assert 'pdserve:tenant_rate_limited_total{tenant="bob"} 0.0' in text
    assert "alice-key" not in text and "bob-key" not in text


def test_the_cache_salt_is_bound_to_the_tenant() -> None:
    secret = b"deployment-secret"

    async def salts(**config) -> list[str]:
        async with tenant_gateway(api_keys=KEYS, **config) as (_, instance, client):
            asks = [("alice-key-1", None), ("alice-key-2", None), ("bob-key", None),
                    ("alice-key-1", "mine"), ("bob-key", "mine")]  # fmt: skip
            for who, salt in asks:
                body = completion(model="m-large", **({"cache_salt": salt} if salt else {}))
                response = await client.post("/v1/completions", json=body, headers=key(who))
                assert response.status_code == 200, response.text
            return [task.cache_salt for task in instance.tasks]

    alice, alice_again, bob, alice_salted, bob_salted = run(salts(deployment_secret=secret))
    assert alice == alice_again  # one tenant, any of its keys: its own cache is shared
    assert len({alice, bob, alice_salted, bob_salted}) == 4  # a salt narrows, never widens
    assert alice == tenant_cache_salt(salt_key(secret), "alice", None) and "alice" not in alice
    assert bob_salted == tenant_cache_salt(salt_key(secret), "bob", "mine") != "mine"
    assert run(salts(deployment_secret=secret))[0] == alice  # the same secret, the same salt
    assert run(salts())[0] != alice  # without one, a random secret per gateway


def test_keys_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def scenario() -> None:
        config = {"api_keys": KEYS, "admin_api_key": ADMIN, "enable_test_hooks": True}
        async with tenant_gateway(**config) as (gateway, _, client):
            logging.getLogger("test").info("config: %r, keys: %r", gateway.config, gateway.keys)
            await client.post("/v1/completions", json=completion(), headers=key("alice-key-1"))
            await client.post("/v1/completions", json=completion(), headers=key("wrong-key"))
            await client.get("/debug/instances", headers=key("bob-key"))

    run(scenario())
    assert "config: GatewayConfig(" in caplog.text
    for secret in ("alice-key", "bob-key", "wrong-key", ADMIN):
        assert secret not in caplog.text
