"""`/admin/controller` on an in-process gateway with no instances: with `--autoscale off`
it says so (and refuses a pause with a 409), with the controller on it shows its state
and pauses it; a bad body is a 400 in OpenAI's shape, a tenant's key a 403."""

from __future__ import annotations

import httpx

from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.gateway import GatewayConfig
from pdserve.gateway.slo_controller import AutoscaleConfig
from pdserve.gateway.slo_policy import PolicyConfig
from pdserve.planner.sim.latency import Calibration, StepLatencyModel
from tests.gateway.in_process import Call, gateway_answers

ADMIN = {"Authorization": "Bearer admin-key"}
TENANT = {"Authorization": "Bearer tenant-key"}
STEP = StepLatencyModel(intercept_s=0.01, per_token_s=1e-5)
AUTOSCALE = AutoscaleConfig(
    PolicyConfig(instance_budget=3, ttft_slo_ms=500.0, itl_slo_ms=50.0, interval_s=2.0),
    Calibration(STEP, STEP),
)


def answers(autoscale: AutoscaleConfig | None, calls: list[tuple]) -> list[httpx.Response]:
    """The gateway's answers to `calls` (method, path, headers, body), in order."""
    config = GatewayConfig(
        model_path=str(embedded_model_path()),
        served_model_names=["m"],
        api_key="tenant-key",
        admin_api_key="admin-key",
        autoscale=autoscale,
    )

    return gateway_answers(config, [Call(*call) for call in calls])


def test_with_autoscale_off_it_says_so_and_refuses_a_pause() -> None:
    state, pause = answers(None, [
        ("GET", "/admin/controller", ADMIN, None),
        ("POST", "/admin/controller", ADMIN, b'{"paused": true}'),
    ])  # fmt: skip
    assert state.status_code == 200 and state.json()["enabled"] is False
    assert pause.status_code == 409
    assert "--autoscale slo" in pause.json()["error"]["message"]


def test_an_operator_reads_and_pauses_the_controller() -> None:
    state, pause, paused, bad, tenant = answers(AUTOSCALE, [
        ("GET", "/admin/controller", ADMIN, None),
        ("POST", "/admin/controller", ADMIN, b'{"paused": true}'),
        ("GET", "/admin/controller", ADMIN, None),
        ("POST", "/admin/controller", ADMIN, b'{"paused": 1}'),
        ("POST", "/admin/controller", TENANT, b'{"paused": false}'),
    ])  # fmt: skip
    body = state.json()
    assert (body["enabled"], body["paused"], body["interval_s"], body["budget"]) == (
        True, False, 2.0, 3)  # fmt: skip
    assert body["decisions"] == [] and body["forecast"] is None
    assert pause.status_code == 200 and paused.json()["paused"] is True
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "paused"
    assert tenant.status_code == 403
