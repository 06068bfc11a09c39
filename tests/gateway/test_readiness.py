"""Honest readiness: /v1/models and /health answer 503 (with Retry-After) until an
instance that can finish a request is up, and at startup until every configured
instance is; a decode instance that keeps recomputing leaves /health at 200 but
"degraded", naming it. A Gateway with InstanceInfos registered by hand; no instance
runs."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from starlette.testclient import TestClient

from pdserve.common.frame_seal import OUTPUTS, Sealer
from pdserve.common.messages import InstanceAddress, InstanceInfo, InstanceOutput, InstanceStats
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


def test_a_decode_instance_that_keeps_recomputing_serves_but_says_so() -> None:
    """Its outputs (over the real output socket) say most of its latest handoffs were
    recomputed: /health stays 200, "degraded", with a warning naming it; the gauge
    `pdserve:kv_pull_recompute_ratio` has the share. A decode instance whose pulls
    recover is "ok" again."""
    gateway = Gateway(GatewayConfig(str(embedded_model_path()), ["m"]))
    decode = info("decode-0", "decode", 41014)
    gateway.register(info("prefill-0", "prefill", 41016))
    gateway.register(decode)
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(gateway.output_address)
    seal = Sealer(OUTPUTS, "decode-0")  # this process's secret, which the gateway's too

    def say(recent: int, recomputed: int, failure: str) -> None:
        stats = InstanceStats(
            kv_pulls_recent=recent, kv_pulls_recomputed=recomputed, kv_pull_last_failure=failure
        )
        output = InstanceOutput(decode.address, stats=stats)
        outputs.send(seal.seal(msgspec.msgpack.encode(output)))

    def health_when(condition) -> dict:
        deadline = time.monotonic() + 5
        while True:
            response = client.get("/health")
            assert response.status_code == 200
            body = response.json()
            if condition(body) or time.monotonic() > deadline:
                return body
            time.sleep(0.02)

    timed_out = "timed out after 2s waiting for KV from prefill instance prefill-0"
    try:
        with TestClient(create_app(gateway)) as client:
            client.portal.call(gateway.start)
            assert client.get("/health").json()["status"] == "ok"
            say(8, 6, timed_out)
            body = health_when(lambda b: b["status"] != "ok")
            assert body["status"] == "degraded"
            [warning] = body["warnings"]
            assert warning.startswith("decode instance decode-0 recomputed 6 of its last 8")
            assert timed_out in warning
            entries = {e["id"]: e for e in body["instances"]}
            assert entries["decode-0"]["kv_pulls"] == {
                "recent": 8, "recomputed": 6, "recomputing": True, "last_failure": timed_out,
            }  # fmt: skip
            assert "kv_pulls" not in entries["prefill-0"]
            ratio = r'^pdserve:kv_pull_recompute_ratio{instance="decode-0",role="decode"} (\S+)$'
            assert re.findall(ratio, client.get("/metrics").text, re.M) == ["0.75"]
            say(32, 2, timed_out)  # the pulls work again: an odd failure is no alarm
            body = health_when(lambda b: b["status"] == "ok")
            assert (body["status"], body["warnings"]) == ("ok", [])
            assert re.findall(ratio, client.get("/metrics").text, re.M) == ["0.0625"]
            client.portal.call(gateway.close)
    finally:
        outputs.close(linger=0)
        context.term()
