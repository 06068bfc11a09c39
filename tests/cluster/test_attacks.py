"""The attack suite (`experiments/attacks.py`) against one real deployment: the Ray
launcher, one prefill instance and one decode instance of three tensor-parallel ranks
(each rank a Ray actor), under a light steady stream of greedy requests. Every
listening port of the deployment's processes, found through /proc as a stranger on the
node would, gets junk, odd shapes, oversized and replayed frames or raw garbage; the
admin API is asked without keys. No request fails or changes its text, no instance is
restarted or fenced, `/health` answers within a second throughout, and each attacked
ZMQ channel counts its drops in `pdserve:dropped_frames_total`, those of the rank
processes included (they reach the driver with the ranks' step results)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from experiments import attack_ports, attacks
from experiments.chaos_harness import GREEDY, Shape, counters
from experiments.serving import API_KEY, ServeProcess, served
from tests.cluster.conftest import RAY_ENV, ray_list
from tests.experiments import attack_watch

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ARGS = (
    "--launcher", "ray", "--num-prefill", "1", "--num-decode", "1",
    "--decode-tensor-parallel-size", "3", "--dtype", "float32", "--kv-cache-memory", "48MiB",
    "--max-model-len", "512", "--threads-per-instance", "1", "--enable-test-hooks",
)  # fmt: skip
SHAPES = [
    Shape(f"greedy-{i}", prompt, GREEDY)
    for i, prompt in enumerate(("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"))
]
# Token ids under a fresh cache salt each time: full blocks enter the prefix cache, so
# the instances publish block events for a stranger's SUB to capture.
SHAPES.append(Shape("salted", [1000 + 37 * i for i in range(40)], GREEDY))
# The ZMQ channels of this deployment that take frames from a stranger, each of which
# must count what it dropped: the instances' task sockets, the gateway's output socket,
# the decode group's rank channel and every rank's KV control socket.
COUNTED = {"tasks", "outputs", "ranks", "kv_control"}
# What the attacks reach but no frame metric can count, and why.
UNCOUNTED = {
    "zmq PUB": "block events: a PUB takes no frames, only subscriptions (a SUB reads it "
    "instead, and what it captures is replayed on the other channels)",
    "tcp": "raw TCP: the decode group's rendezvous store (torch's TCPStore), gloo's and "
    "UCX's listeners and Ray's gRPC servers carry no sealed frames",
    "http": "the HTTP API: garbage gets HTTP errors, keys guard /admin (checked below)",
}


@pytest.fixture(scope="module")
def server(ray_cluster: str) -> Iterator[ServeProcess]:
    with served(*ARGS, "--ray-address", ray_cluster, env=RAY_ENV, stop_timeout_s=60) as process:
        yield process


def test_junk_to_a_rank_process_is_counted_in_metrics(server, ray_cluster) -> None:
    """Rank 1 of the decode group is a process of its own: what its KV control socket
    drops reaches /metrics through its driver."""
    [rank1] = [
        a for a in ray_list("actors", ray_cluster)
        if a["class_name"] == "TensorParallelRank" and a["state"] == "ALIVE"
        and a["repr_name"] == "decode-0-rank-1"
    ]  # fmt: skip
    listening = attack_ports.listening_sockets()
    ports = [
        attack_ports.Port(rank1["pid"], "rank 1", *listening[inode])
        for inode in attack_ports.socket_inodes(rank1["pid"])
        if inode in listening
    ]
    routers = [
        p for p, k in zip(ports, attack_ports.identify_all(ports), strict=True) if k == "zmq ROUTER"
    ]
    assert len(routers) == 1, ports  # its KV control socket
    before = attack_watch.drops(server)
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 2000)
        dealer.connect(routers[0].endpoint)
        for _ in range(3):
            dealer.send(b"not a sealed frame")
        dealer.close()
    finally:
        context.term()
    assert "kv_control" in attack_watch.grown(server, before, {"kv_control"})
    deadline = time.monotonic() + 10
    while attack_watch.drops(server).get("kv_control", 0.0) < before.get("kv_control", 0.0) + 3:
        assert time.monotonic() < deadline, attack_watch.drops(server)
        time.sleep(0.3)


def test_every_port_attacked_under_load(server, ray_cluster) -> None:
    ports = attack_ports.deployment_ports(server.base_url, ray_cluster)
    lives_before, counters_before = attack_watch.instances(server), counters(server)
    drops_before, oversized_before = attack_watch.drops(server), attack_watch.oversized(server)
    attacked = attack_watch.attack_under_load(server, ports, SHAPES)
    admin = attacks.probe_admin(server.base_url, API_KEY)
    outcomes, report = attacked.outcomes, attacked.report()
    print(report)
    print(f"{len(ports)} ports attacked in {attacked.attack_s:.1f} s; "
          f"{len(attacked.probes)} requests; slowest /health "
          f"{attacked.slowest_health_s:.3f} s of {attacked.health_polls}")  # fmt: skip

    # Every port was found and attacked; what cannot be counted is listed with its reason.
    kinds = {o.kind for o in outcomes}
    assert kinds <= {"zmq PULL", "zmq ROUTER", *UNCOUNTED} and "http" in kinds, report
    assert all(o.sent for o in outcomes), report
    routers = [o for o in outcomes if o.kind == "zmq ROUTER"]
    # The decode driver's rank channel and the KV control socket of each of the 4 ranks.
    assert len(routers) == 5 and len({o.port.pid for o in routers}) == 5, report
    assert len([o for o in outcomes if o.kind == "zmq PULL"]) == 3, report  # 2 tasks, outputs
    assert attacked.captured, report  # block events, read by a stranger's SUB
    # Each attacked ZMQ channel counted its drops, and a frame one byte past its limit
    # as `oversized` (the rank processes' with their next step).
    up = attack_watch.grown(server, drops_before, COUNTED)
    drops_after = attack_watch.drops(server)
    print({c: n - drops_before.get(c, 0.0) for c, n in drops_after.items()})
    assert up >= COUNTED, (drops_before, drops_after)
    assert (
        attack_watch.grown(server, oversized_before, COUNTED, attack_watch.oversized) >= COUNTED
    ), attack_watch.oversized(server)

    attack_watch.assert_unharmed(server, attacked, lives_before, counters_before)
    # The operator routes stay closed to a stranger and to a tenant.
    for route, status in admin.items():
        assert status == (401 if "(none key)" in route else 403), admin
