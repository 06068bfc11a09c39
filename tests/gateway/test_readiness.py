"""Honest readiness: /v1/models and /health answer 503 (with Retry-After) until an
instance that can finish a request is up, and at startup until every configured
instance is. A Gateway with InstanceInfos registered by hand; no instance runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from pdserve.common.messages import InstanceAddress, InstanceInfo
from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.app import create_app
from pdserve.gateway.gateway import Gateway, GatewayConfig


def info(instance_id: str, role: str, port: int) -> InstanceInfo:
    address = InstanceAddress(instance_id, role, f"tcp://127.0.0.1:{port}")
    return InstanceInfo(address, f"tcp://127.0.0.1:{port + 1}", "m", 1024, 49152, 16, 64, 8)


@pytest.fixture
def make_gateway() -> Iterator:
    made: list[Gateway] = []

    def make(expected_instances: int = 0) -> tuple[Gateway, TestClient]:
        config = GatewayConfig(
            str(embedded_model_path()), ["m"], expected_instances=expected_instances
        )
        gateway = Gateway(config)
        made.append(gateway)
        return gateway, TestClient(create_app(gateway))

    yield make
    for gateway in made:
        asyncio.run(gateway.close())


def assert_unavailable(client: TestClient) -> None:
    for path in ("/v1/models", "/health"):
        response = client.get(path)
        assert response.status_code == 503, (path, response.text)
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "unavailable"


def assert_ready(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models")
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == ["m"]


def test_nothing_is_ready_before_an_instance_registers(make_gateway) -> None:
    gateway, client = make_gateway()
    assert_unavailable(client)


def test_a_prefill_instance_alone_cannot_finish_a_request(make_gateway) -> None:
    gateway, client = make_gateway()
    gateway.register(info("prefill-0", "prefill", 41000))
    assert_unavailable(client)
    gateway.register(info("decode-0", "decode", 41002))
    assert_ready(client)
    gateway.instance_lost("decode-0", "test")
    assert_unavailable(client)


def test_a_colocated_instance_is_enough(make_gateway) -> None:
    gateway, client = make_gateway()
    gateway.register(info("colocated-0", "colocated", 41004))
    assert_ready(client)


def test_at_startup_every_configured_instance_must_be_up(make_gateway) -> None:
    gateway, client = make_gateway(expected_instances=3)
    gateway.register(info("decode-0", "decode", 41006))
    gateway.register(info("prefill-0", "prefill", 41008))
    assert_unavailable(client)  # decode-1 still loading
    assert "2/3" in client.get("/health").json()["error"]["message"]
    gateway.register(info("decode-1", "decode", 41010))
    assert_ready(client)
    gateway.instance_lost("decode-0", "test")
    assert_ready(client)  # after startup: one decode instance left is enough


def test_the_vllm_series_carry_the_served_model_name(make_gateway) -> None:
    gateway, client = make_gateway()
    gateway.register(info("colocated-0", "colocated", 41012))
    text = client.get("/metrics").text
    assert 'model_name="m"' in text and 'model_name=""' not in text
