"""Restarts, drain and scale under the Ray launcher: one prefill and two decode actors on
the session's Ray cluster (2 CPUs). A decode actor's process killed (SIGKILL) under
streams loses no stream (greedy and seeded at temperature 0.8 end as a fault-free run
would); the supervisor starts a new actor in the next epoch and it rejoins within a
minute; a decode instance drained and the pool scaled up again under streams drop
nothing (the new actor takes the drained one's CPUs: the cluster has no more). The tests
run in file order on one server.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from experiments.serving import ServeProcess, counter, pool, served, wait_for
from pdserve.cluster.pools import START_WORKERS
from pdserve.cluster.ray_watch import CREATE_WORKERS
from tests.cluster.conftest import RAY_ENV, ray_list
from tests.cluster.recovery_requests import (
    ADMIN,
    GREEDY,
    MIXED,
    RecoveryRequests,
    assert_scaling_up_answers_at_once,
)

pytestmark = pytest.mark.slow

ARGS = (
    "--launcher", "ray", "--num-prefill", "1", "--num-decode", "2", "--dtype", "float32",
    "--kv-cache-memory", "48MiB", "--max-model-len", "512", "--routing-policy", "round_robin",
    "--threads-per-instance", "1", "--enable-test-hooks",
)  # fmt: skip
MAX_TOKENS = 192  # long enough that no stream ends before the last one begins
REQUESTS = RecoveryRequests("The capital of France is", MAX_TOKENS)


@pytest.fixture(scope="module")
def server(ray_cluster: str) -> Iterator[ServeProcess]:
    with served(*ARGS, "--ray-address", ray_cluster, env=RAY_ENV, stop_timeout_s=60) as process:
        yield process


def test_a_killed_decode_actor_loses_no_stream_and_is_restarted(server, ray_cluster) -> None:
    expected = REQUESTS.texts(server, MIXED)
    pid = server.instances()["decode-0"]["pid"]
    streams = REQUESTS.streams(server, MIXED)
    assert all(len(s.chunks) < MAX_TOKENS for s in streams)  # all mid-stream
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    REQUESTS.assert_streams_end_as(streams, expected)
    assert counter(server, "requests_migrated_total") == 2.0
    wait_for(lambda: pool(server, "decode") == ["decode-0", "decode-1"],
             60 - (time.monotonic() - killed_at), "decode-0 back within a minute")  # fmt: skip
    assert server.get("/health").status_code == 200
    restarted = server.instances()["decode-0"]
    assert restarted["pid"] != pid and restarted["epoch"] == 1
    assert counter(server, "num_instances_restarted_total") == 1.0
    # The session's cluster also lists the dead actors of other modules' servers.
    states = [a["state"] for a in ray_list("actors", ray_cluster) if a["name"] == "decode-0"]
    assert states.count("ALIVE") == 1 and "DEAD" in states, states
    assert REQUESTS.texts(server, MIXED) == expected
    server.assert_blocks_free_or_cached()


def test_draining_and_scaling_up_under_load_drop_nothing(server) -> None:
    expected = REQUESTS.complete(server, GREEDY)
    streams = REQUESTS.streams(server, [GREEDY, GREEDY])  # one on each decode instance
    assert server.post("/admin/instances/decode-1/drain", headers=ADMIN).status_code == 200
    # The pool starters and the actor creators: no thread per actor.
    assert_scaling_up_answers_at_once(server, 2, START_WORKERS + CREATE_WORKERS)
    more = REQUESTS.streams(server, [GREEDY])  # while decode-1 drains: on decode-0
    REQUESTS.assert_streams_end_as(streams + more, [expected] * 3)
    # decode-1 stops once empty; decode-2 gets its CPUs and joins.
    wait_for(lambda: pool(server, "decode") == ["decode-0", "decode-2"], 60, "decode-2 to join")
    streams = REQUESTS.streams(server, [GREEDY, GREEDY])
    REQUESTS.assert_streams_end_as(streams, [expected] * len(streams))
    assert counter(server, "requests_migrated_total") == 2.0  # none since the kill
    assert counter(server, "num_instances_restarted_total") == 1.0  # the drained one stays down
    server.assert_blocks_free_or_cached()
