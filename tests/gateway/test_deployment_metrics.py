"""The series the alert rules (deploy/prometheus/alerts.yaml) compare live series
against: `pdserve:ttft_slo_seconds` only with `--ttft-slo-ms`, each instance's
`pdserve:max_num_seqs`, and each pool's `pdserve:pool_size` and
`pdserve:pool_instances_up` as the cluster's pools and the scheduler see them. A
Gateway with instances registered by hand, then the shared server's own scrape."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.gateway import Gateway, GatewayConfig
from tests.deploy.rules import rules
from tests.gateway.conftest import TTFT_SLO_MS
from tests.gateway.exported_series import series_in
from tests.gateway.instances import instance_info

Samples = dict[str, list[tuple[dict[str, str], float]]]


class Pools:
    """The cluster's pools as `/admin` sees them (`cluster/pools.py`): members only."""

    def __init__(self, members: dict[str, list[str]]) -> None:
        self._members = members

    def members(self, role: str) -> list[str]:
        return list(self._members.get(role, []))

    def start(self, role: str, count: int) -> list[str]:
        raise ValueError("not started here")

    def retire(self, instance_id: str) -> None:
        pass

    def stop(self, instance_id: str) -> None:
        pass


@pytest.fixture
def make_gateway() -> Iterator:
    made: list[Gateway] = []

    def make(ttft_slo_ms: float | None = None) -> Gateway:
        config = GatewayConfig(str(embedded_model_path()), ["m"], ttft_slo_ms=ttft_slo_ms)
        made.append(Gateway(config))
        return made[-1]

    yield make
    for gateway in made:
        asyncio.run(gateway.close())


def samples(text: str) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    matches = [v for got, v in found.get(name, []) if labels.items() <= got.items()]
    assert len(matches) == 1, (name, labels, found.get(name))
    return matches[0]


def test_without_the_flag_and_a_cluster_neither_slo_nor_pools_show(make_gateway) -> None:
    gateway = make_gateway()
    gateway.register(instance_info("colocated-0", "colocated", max_num_seqs=4))
    found = samples(gateway.metrics.render().decode())
    assert "pdserve:ttft_slo_seconds" not in found  # a 0 would be an SLO nobody meets
    assert "pdserve:pool_size" not in found and "pdserve:pool_instances_up" not in found
    assert value(found, "pdserve:max_num_seqs", instance="colocated-0") == 4


def test_slo_seats_and_pools_follow_the_deployment(make_gateway) -> None:
    gateway = make_gateway(ttft_slo_ms=1500)
    gateway.register(instance_info("prefill-0", "prefill", max_num_seqs=8))
    gateway.register(instance_info("decode-0", "decode", max_num_seqs=16))
    gateway.register(instance_info("decode-1", "decode", max_num_seqs=32))
    # decode-2 was just added by a scale-up and is still loading.
    members = {"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1", "decode-2"]}
    gateway.pools = Pools(members)
    found = samples(gateway.metrics.render().decode())
    assert value(found, "pdserve:ttft_slo_seconds") == 1.5
    assert value(found, "pdserve:max_num_seqs", role="decode", instance="decode-1") == 32
    assert value(found, "pdserve:pool_size", role="decode") == 3
    assert value(found, "pdserve:pool_instances_up", role="decode") == 2
    assert value(found, "pdserve:pool_size", role="prefill") == 1
    assert value(found, "pdserve:pool_instances_up", role="prefill") == 1
    assert {labels["role"] for labels, _ in found["pdserve:pool_size"]} == {"prefill", "decode"}
    gateway.instance_lost("decode-0", "killed")
    found = samples(gateway.metrics.render().decode())
    assert value(found, "pdserve:pool_instances_up", role="decode") == 1
    # Drained: it leaves the pool, and a pool of its size is whole again.
    gateway.pools = Pools({**members, "decode": ["decode-1", "decode-2"]})
    gateway.register(instance_info("decode-2", "decode", max_num_seqs=32))
    found = samples(gateway.metrics.render().decode())
    assert value(found, "pdserve:pool_size", role="decode") == 2
    assert value(found, "pdserve:pool_instances_up", role="decode") == 2


def test_the_server_exports_every_series_the_alert_rules_read(server) -> None:
    found = samples(server.get("/metrics").text)
    families = set()
    for name in found:
        for suffix in ("_bucket", "_sum", "_count"):
            name = name.removesuffix(suffix)
        families.add(name)
    for rule in rules():
        missing = series_in(rule["expr"]) - families
        assert not missing, f"{rule['alert']}: the server's /metrics lacks {missing}"
    assert value(found, "pdserve:ttft_slo_seconds") == TTFT_SLO_MS / 1000
    assert value(found, "pdserve:max_num_seqs", instance="colocated-0") == 256  # the default
    assert value(found, "pdserve:pool_size", role="colocated") == 1
    assert value(found, "pdserve:pool_instances_up", role="colocated") == 1
