"""Placement and addresses when joining a Ray cluster (no cluster needed): the pools'
custom resources, the cluster's inventory instead of this machine's, and where each
socket binds."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.cluster.addresses import (
    ADVERTISE_HOST_ENV,
    LOOPBACK,
    across_nodes,
    instance_host,
    resolve_host,
)
from pdserve.cluster.deployment import Deployment, ServeError
from pdserve.cluster.serve import instance_specs
from pdserve.instance.spec import NODE_HOST


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_pools_ask_for_their_custom_resources() -> None:
    plan = Deployment.from_args(
        parse("--prefill-resources", '{"node_a": 1}', "--decode-resources", '{"node_b": 0.5}'),
        cores=[0, 1],
        gpus=[],
    )
    assert plan.resources == {"prefill": {"node_a": 1.0}, "decode": {"node_b": 0.5}}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-resources", "{node_a: 1}"], "--prefill-resources: not JSON"),
        (["--decode-resources", '{"node_b": 0}'], "positive amounts"),
        (["--decode-resources", '["node_b"]'], "positive amounts"),
        (["--prefill-resources", '{"GPU": 1}'], "GPU is set by pdserve itself"),
        (["--launcher", "local", "--decode-resources", '{"b": 1}'], "needs --launcher ray"),
    ],
)
def test_bad_resources_are_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(ServeError, match=message):
        Deployment.from_args(parse(*flags), cores=[0, 1], gpus=[])


def test_the_cluster_inventory_places_gpus_the_driver_lacks() -> None:
    """Two GPUs somewhere in the cluster, none here: one per instance, as Ray resources."""
    plan = Deployment.from_args(parse("--ray-address", "10.0.0.1:6379"), list(range(8)), ["0", "1"])
    assert [(i.device, i.num_gpus) for i in plan.instances] == [("cuda", 1.0), ("cuda", 1.0)]
    assert [i.num_threads for i in plan.instances] == [4, 4]


def test_instances_bind_their_node_address_only_across_nodes() -> None:
    assert not across_nodes("ray", None) and not across_nodes("local", "10.0.0.1:6379")
    assert across_nodes("ray", "10.0.0.1:6379")
    joined = Deployment.from_args(parse("--ray-address", "10.0.0.1:6379"), [0, 1, 2, 3, 4], [])
    specs = [s for wave in instance_specs(joined, "/m", "tcp://10.0.0.1:5", True) for s in wave]
    assert {s.host for s in specs} == {NODE_HOST}
    assert all(s.cpus == [] for s in specs)  # the driver's cores mean nothing on node B
    local = Deployment.from_args(parse("--launcher", "local"), [0, 1, 2, 3], [])
    specs = [s for wave in instance_specs(local, "/m", "tcp://127.0.0.1:5") for s in wave]
    assert {s.host for s in specs} == {LOOPBACK} and specs[0].cpus == [0, 1]
    assert instance_host(False) == LOOPBACK


def test_a_node_override_wins_over_ray(monkeypatch) -> None:
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "192.168.7.3")
    assert resolve_host(NODE_HOST) == "192.168.7.3"
    assert resolve_host("127.0.0.1") == "127.0.0.1"  # a concrete host is left alone
