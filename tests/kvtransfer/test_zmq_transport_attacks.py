"""The `zmq` KV transport's data sockets (`kvtransfer/zmq_transport.py`) attacked as a
stranger on the node would while KV moves through them: one prefill and one decode
instance (local processes) with `--kv-transport zmq`, under a light steady stream of
greedy requests. Every listening port of the deployment, found through /proc, gets the
attack suite (`experiments/attacks.py`): junk, odd shapes, replays, and a chunk one byte
past the channel's limit. No request fails or changes its text, no KV transfer fails or
falls back to recomputing, no instance is restarted, `/health` answers within a second,
and the data sockets count their drops (`kv_data`, the long chunk as `oversized`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from experiments import attack_ports
from experiments.chaos_harness import GREEDY, Shape, counters
from experiments.serving import LOCAL, ServeProcess, served
from tests.experiments import attack_watch

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "1", "--kv-transport", "zmq",
    "--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "512",
)  # fmt: skip
# Long prompts under fresh cache salts: every request moves whole blocks of KV.
SHAPES = [
    Shape(f"salted-{i}", [1000 + 37 * j + i for j in range(64)], GREEDY) for i in range(2)
] + [Shape("short", "The capital of France is", GREEDY)]
KV_BYTES = "pdserve:kv_transfer_bytes_total"


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS) as process:
        yield process


def kv_bytes(server: ServeProcess) -> float:
    lines = server.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(KV_BYTES))


def test_the_kv_data_sockets_attacked_while_kv_moves(server) -> None:
    ports = attack_ports.deployment_ports(server.base_url)
    lives_before, counters_before = attack_watch.instances(server), counters(server)
    drops_before, oversized_before = attack_watch.drops(server), attack_watch.oversized(server)
    moved_before = kv_bytes(server)
    attacked = attack_watch.attack_under_load(server, ports, SHAPES)
    report = attacked.report()
    print(report)
    print(f"{len(ports)} ports attacked in {attacked.attack_s:.1f} s; "
          f"{len(attacked.probes)} requests")  # fmt: skip

    # The tasks of both instances, the gateway's outputs, each instance's KV data.
    pulls = [o for o in attacked.outcomes if o.kind == "zmq PULL"]
    assert len(pulls) == 5 and all("kv_data limit + 1 byte" in o.sent for o in pulls), report
    assert "kv_data" in attack_watch.grown(server, drops_before, {"kv_data"}), attack_watch.drops(
        server
    )
    assert "kv_data" in attack_watch.grown(
        server, oversized_before, {"kv_data"}, attack_watch.oversized
    ), attack_watch.oversized(server)

    attack_watch.assert_unharmed(server, attacked, lives_before, counters_before)
    after = counters(server)
    for name in ("kv_failures", "recomputed", "lease_expiries"):
        assert after[name] == counters_before[name], (name, after)
    assert kv_bytes(server) > moved_before  # the KV really moved, through these sockets
