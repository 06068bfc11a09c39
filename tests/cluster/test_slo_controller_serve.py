"""`pdserve serve --autoscale slo` on one server (local launcher, 1 prefill + 2 decode,
a decision every half second): `GET /admin/controller` shows the controller, its
decisions and the split; `POST /admin/controller` pauses and resumes it (a 400 for a
bad body, a 403 for a tenant's key); `/metrics` has its series. The policy's decisions
are whatever the shipped policy answers: a policy that raises is a hold with reason
"policy_error", and the gateway serves on either way."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.serving import ADMIN_KEY, LOCAL, ServeProcess, served

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
STEPS = [
    {"batch_tokens": n, "attention_pairs": n * n, "seconds": 0.001 + n * 1e-5}
    for n in (1, 8, 64, 256)
]  # a step-latency model's measurements, as `pdserve bench calibrate` writes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    calibration = Path(tmp_path_factory.mktemp("slo")) / "calibration.json"
    calibration.write_text(json.dumps({"prefill": STEPS, "decode": STEPS, "tp": 1}))
    args = (
        *LOCAL, "--num-prefill", "1", "--num-decode", "2", "--kv-cache-memory", "32MiB",
        "--max-model-len", "512", "--autoscale", "slo", "--ttft-slo-ms", "2000",
        "--itl-slo-ms", "200", "--calibration", str(calibration),
        "--autoscale-interval-s", "0.5",
    )  # fmt: skip
    with served(*args, exit_zero=True) as process:
        yield process


def controller(server: ServeProcess) -> dict:
    response = server.get("/admin/controller", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_controller_decides_every_interval_and_the_gateway_serves(server) -> None:
    deadline = time.monotonic() + 20
    while not controller(server)["decisions"] and time.monotonic() < deadline:
        time.sleep(0.25)
    body = controller(server)
    assert body["enabled"] and not body["paused"]
    assert (body["interval_s"], body["budget"]) == (0.5, 3)
    assert set(body["actual"]) == {"prefill", "decode"} and sum(body["actual"].values()) <= 3
    last = body["decisions"][-1]
    assert {"at", "age_s", "action", "reason", "detail"} <= set(last)
    reply = server.openai().completions.create(model="SmolLM2-135M-Instruct", prompt="Hi",
                                               max_tokens=4, temperature=0)  # fmt: skip
    assert reply.usage.completion_tokens == 4  # whatever the policy answers
    metrics = server.get("/metrics").text
    assert 'pdserve:controller_actual_instances{role="decode"}' in metrics
    assert 'pdserve:controller_target_instances{role="prefill"}' in metrics
    decided = f'{{action="{last["action"]}",reason="{last["reason"]}"}}'
    assert f"pdserve:controller_decisions_total{decided}" in metrics


def test_an_operator_pauses_and_resumes_it(server) -> None:
    paused = server.post("/admin/controller", json={"paused": True}, headers=ADMIN)
    assert paused.status_code == 200 and paused.json()["paused"] is True
    count = len(controller(server)["decisions"])
    time.sleep(1.5)  # three intervals
    assert len(controller(server)["decisions"]) == count
    resumed = server.post("/admin/controller", json={"paused": False}, headers=ADMIN)
    assert resumed.json()["paused"] is False


def test_bad_bodies_and_tenant_keys_are_refused(server) -> None:
    bad = server.post("/admin/controller", json={"paused": "yes"}, headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "paused"
    extra = server.post("/admin/controller", json={"paused": True, "x": 1}, headers=ADMIN)
    assert extra.status_code == 400
    assert server.get("/admin/controller").status_code == 403  # the tenant's key
    assert server.post("/admin/controller", json={"paused": True}).status_code == 403
