"""One prefill and two decode instances (local processes): a decode instance killed
mid-stream loses no stream (each is migrated to the other decode instance with the
tokens already streamed as output, and ends as a fault-free run would, greedy and
seeded alike); the supervisor restarts it (a new process in a new epoch) and it serves
again within a minute; one paused (SIGSTOP) past `--instance-timeout` under streams is
fenced: its streams migrate alike, it is killed (gone even once resumed) and replaced,
the fence and the restart counted in /metrics; under streaming load a pool scales up,
an instance drains and a pool scales down without a request dropped or failed (behind
the admin key); a scale past `--max-pool-size` is a 400 at once, a legal one a 202 at
once, `/health` answering throughout and the gateway's threads bounded.

The tests run in file order on one server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from experiments.serving import LOCAL, ServeProcess, counter, pool, served, wait_for
from pdserve.cluster.pools import START_WORKERS
from tests.cluster.recovery_requests import (
    ADMIN,
    GREEDY,
    MIXED,
    RecoveryRequests,
    assert_scaling_up_answers_at_once,
    scale_decode,
)
from tests.processes import still_running

pytestmark = pytest.mark.slow

TIMEOUT_S = 3.0
ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "2", "--dtype", "bfloat16",
    "--kv-cache-memory", "24MiB", "--max-model-len", "512", "--routing-policy", "round_robin",
    "--instance-timeout", str(TIMEOUT_S),
)  # fmt: skip
MAX_TOKENS = 192  # long enough that no stream ends before the last one begins
REQUESTS = RecoveryRequests("The capital of France is", MAX_TOKENS)


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS) as process:
        yield process


KILLED: dict[str, tuple[int, float]] = {}  # instance id → (its pid, when it was killed)


def kill(server: ServeProcess, instance_id: str) -> tuple[int, float]:
    pid = server.instances()[instance_id]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


def alive(server: ServeProcess, instance_id: str) -> bool:
    return any(
        entry["id"] == instance_id and entry["alive"]
        for entry in server.get("/health").json()["instances"]
    )


def test_streams_of_a_killed_decode_instance_are_migrated_token_for_token(server) -> None:
    expected = REQUESTS.texts(server, MIXED)
    streams = REQUESTS.streams(server, MIXED)
    assert all(len(s.chunks) < MAX_TOKENS for s in streams)  # all mid-stream
    KILLED["decode-0"] = kill(server, "decode-0")
    REQUESTS.assert_streams_end_as(streams, expected)
    assert counter(server, "requests_migrated_total") == 2.0
    server.assert_blocks_free_or_cached()


def test_a_killed_instance_is_restarted_and_serves_again(server) -> None:
    pid, killed_at = KILLED["decode-0"]  # by the test before
    wait_for(lambda: alive(server, "decode-0"), 60 - (time.monotonic() - killed_at),
             "decode-0 to be back within a minute of its death")  # fmt: skip
    assert server.instances()["decode-0"]["pid"] != pid  # a new process
    assert counter(server, "num_instances_restarted_total") == 1.0
    expected = REQUESTS.complete(server, GREEDY)
    kill(server, "decode-1")  # decode-0 alone serves until decode-1 is back
    wait_for(lambda: not alive(server, "decode-1"), 10, "decode-1's death to be seen")
    assert pool_gauges(server, "decode") == (2.0, 1.0)  # what PdservePoolShort reads
    assert REQUESTS.complete(server, GREEDY) == expected
    wait_for(lambda: alive(server, "decode-1"), 60, "decode-1 to be back")
    assert counter(server, "num_instances_restarted_total") == 2.0
    assert pool_gauges(server, "decode") == (2.0, 2.0)
    server.assert_blocks_free_or_cached()


def pool_gauges(server: ServeProcess, role: str) -> tuple[float, float]:
    """`pdserve:pool_size` and `pdserve:pool_instances_up` of the pool."""
    label = f'{{role="{role}"}}'
    return counter(server, "pool_size" + label), counter(server, "pool_instances_up" + label)


def test_a_paused_decode_instance_is_fenced_killed_and_replaced(server) -> None:
    expected = REQUESTS.texts(server, MIXED)
    streams = REQUESTS.streams(server, MIXED)
    pid = server.instances()["decode-0"]["pid"]
    assert all(not s.done for s in streams)  # all mid-stream
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(TIMEOUT_S + 5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed already, as it should be
            os.kill(pid, signal.SIGCONT)
    REQUESTS.assert_streams_end_as(streams, expected)
    assert counter(server, "requests_migrated_total") == 4.0  # 2 of the kill, 2 of the pause
    assert not still_running([pid], 10), "the paused process was not killed"
    wait_for(lambda: alive(server, "decode-0"), 60, "decode-0's replacement")
    assert server.instances()["decode-0"]["pid"] != pid
    assert counter(server, 'num_instances_fenced_total{instance="decode-0",role="decode"}') == 1.0
    assert counter(server, "num_instances_restarted_total") == 3.0
    server.assert_blocks_free_or_cached()


def test_scaling_and_draining_under_load_drop_no_request(server) -> None:
    for path in ("/admin/pools/decode/scale", "/admin/instances/decode-0/drain"):
        assert server.post(path, json={"size": 3}).status_code == 403  # a tenant's key
    expected = REQUESTS.complete(server, GREEDY)
    # The starter's threads and the new process's stdout reader, nothing per request.
    assert_scaling_up_answers_at_once(server, 3, START_WORKERS + 1)
    wait_for(lambda: "decode-2" in pool(server, "decode"), 60, "decode-2 to join its pool")
    assert pool_gauges(server, "decode") == (3.0, 3.0)

    streams = REQUESTS.streams(server, [GREEDY] * 3)  # round robin: one on each instance
    assert server.post("/admin/instances/decode-0/drain", headers=ADMIN).status_code == 200
    scaled = scale_decode(server, 1)
    assert scaled.json()["draining"] == ["decode-2"]  # the newest goes
    REQUESTS.assert_streams_end_as(streams, [expected] * len(streams))
    wait_for(lambda: pool(server, "decode") == ["decode-1"], 30, "the drained ones to leave")
    assert REQUESTS.complete(server, GREEDY) == expected
    assert counter(server, "requests_migrated_total") == 4.0  # none since the pause
    assert counter(server, "num_instances_restarted_total") == 3.0  # drained stay down
    assert pool_gauges(server, "decode") == (1.0, 1.0)  # drained ones leave the pool's size
    server.assert_blocks_free_or_cached()
