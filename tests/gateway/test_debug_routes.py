"""The /debug/* routes exist only on a gateway started with --enable-test-hooks; without it
they answer 404 exactly like a route that does not exist. An in-process gateway with no
instances is enough: whether a route exists does not depend on what is behind it."""

from __future__ import annotations

import httpx
import pytest

from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.gateway import GatewayConfig
from tests.gateway.in_process import Call, gateway_answers

DEBUG_ROUTES = [
    ("GET", "/debug/instances"),
    ("POST", "/debug/routing-policy?name=round_robin"),
    ("POST", "/debug/instances/colocated-0/leak?blocks=1"),
]


def answers(enable_test_hooks: bool, calls: list[tuple[str, str]]) -> list[httpx.Response]:
    """The gateway's answers to `calls`, in order."""
    config = GatewayConfig(
        model_path=str(embedded_model_path()),
        served_model_names=["m"],
        enable_test_hooks=enable_test_hooks,
    )

    return gateway_answers(config, [Call(method, path) for method, path in calls])


@pytest.mark.parametrize(("method", "path"), DEBUG_ROUTES)
def test_debug_routes_are_unknown_without_test_hooks(method: str, path: str) -> None:
    unknown, debug = answers(False, [(method, "/debug/no-such-route"), (method, path)])
    assert unknown.status_code == 404
    assert (debug.status_code, debug.json()) == (unknown.status_code, unknown.json())


def test_debug_routes_exist_with_test_hooks() -> None:
    instances, policy, bad_policy, leak = answers(
        True,
        [
            ("GET", "/debug/instances"),
            ("POST", "/debug/routing-policy?name=round_robin"),
            ("POST", "/debug/routing-policy?name=no-such-policy"),
            ("POST", "/debug/instances/no-such-instance/leak?blocks=1"),
        ],
    )
    assert instances.status_code == 200 and instances.json() == {"instances": {}}
    assert policy.status_code == 200 and policy.json() == {"routing_policy": "round_robin"}
    assert bad_policy.status_code == 400 and bad_policy.json()["error"]["param"] == "name"
    assert leak.status_code == 400  # the route is there; the instance is not
