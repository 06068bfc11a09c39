"""A tensor-parallel instance under the Ray launcher: each rank is a Ray actor of its own in
the instance's STRICT_PACK placement group (one bundle per rank), greedy text equals the
single-process engine's, and a killed rank actor takes the group down at once (its own
module: the Ray modules' servers hold the session cluster's CPUs while their module
runs)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from experiments.serving import MODEL, BackgroundStream, ServeProcess, served
from pdserve.common.sampling_params import SamplingParams
from tests.cluster.conftest import RAY_ENV, ray_list
from tests.processes import running, still_running

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
GROUP = "colocated-0-ranks"


@pytest.fixture(scope="module")
def server(ray_cluster: str) -> Iterator[ServeProcess]:
    with served(
        "--mode", "colocated", "--launcher", "ray", "--ray-address", ray_cluster,
        "--num-colocated", "1", "-tp", "3", "--dtype", "float32", "--kv-cache-memory",
        "64MiB", "--max-model-len", "512", "--enable-test-hooks", env=RAY_ENV,
    ) as process:  # fmt: skip
        yield process
    left = [g for g in ray_list("placement-groups", ray_cluster) if g["name"] == GROUP]
    assert left and all(g["state"] == "REMOVED" for g in left)


@pytest.fixture(scope="module")
def greedy() -> list[str]:
    from pdserve import LLM

    llm = LLM(dtype="float32", num_threads=1, kv_cache_memory=64 << 20, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def our_group(address: str) -> dict:
    [group] = [
        g for g in ray_list("placement-groups", address)
        if g["name"] == GROUP and g["state"] == "CREATED"
    ]  # fmt: skip
    return group


def rank_actors(address: str, group_id: str) -> list[dict]:
    return sorted(
        (a for a in ray_list("actors", address)
         if a["class_name"] == "TensorParallelRank" and a["placement_group_id"] == group_id),
        key=lambda a: a["repr_name"],
    )  # fmt: skip


def test_each_rank_is_an_actor_in_its_bundle_and_serves_the_engines_text(
    server, ray_cluster, greedy
) -> None:
    client = server.openai()
    for prompt, want in zip(PROMPTS, greedy, strict=True):
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert result.choices[0].text == want, prompt
    group = our_group(ray_cluster)
    assert len(group["bundles"]) == 3, group
    import ray  # the session fixture's connection

    table = ray.util.placement_group_table()[group["placement_group_id"]]
    assert table["strategy"] == "STRICT_PACK", table
    ranks = rank_actors(ray_cluster, group["placement_group_id"])
    assert [a["repr_name"] for a in ranks] == [f"colocated-0-rank-{r}" for r in range(3)]
    assert all(a["state"] == "ALIVE" for a in ranks), ranks
    assert len({a["pid"] for a in ranks}) == 3  # a process each
    pg = group["placement_group_id"]
    for rank, actor in enumerate(ranks):  # in bundle `rank`, its share: 2 CPUs over 3 ranks
        asked = actor["required_resources"]
        assert asked.get(f"CPU_group_{rank}_{pg}") == pytest.approx(2 / 3, abs=1e-3), asked
    [driver] = [
        a for a in ray_list("actors", ray_cluster)
        if a["name"] == "colocated-0" and a["state"] == "ALIVE"
    ]  # fmt: skip
    assert driver["placement_group_id"] == group["placement_group_id"]
    assert not [k for k in driver["required_resources"] if k.startswith("CPU")], driver
    assert driver["pid"] not in {a["pid"] for a in ranks}
    server.assert_blocks_free_or_cached()


def test_a_killed_rank_actor_ends_its_group_and_the_instance_is_started_again(
    server, ray_cluster, greedy
) -> None:
    group_id = our_group(ray_cluster)["placement_group_id"]
    ranks = rank_actors(ray_cluster, group_id)
    body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 400,
            "stream": True, "ignore_eos": True}  # fmt: skip
    stream = BackgroundStream(server, body)
    deadline = time.monotonic() + 30
    while not stream.chunks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream.chunks, "the stream never started"
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    stream.join(timeout_s=15)
    assert time.monotonic() - killed < 10, "the stream outlived its group by far"
    # Its only instance is gone, so the stream cannot move: it ends with the reason.
    assert stream.errors and "lost its worker group" in stream.errors[0], stream.errors
    assert "rank 1" in stream.errors[0], stream.errors
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if all(a["state"] == "DEAD" for a in rank_actors(ray_cluster, group_id)):
            break
        time.sleep(0.3)
    assert all(a["state"] == "DEAD" for a in rank_actors(ray_cluster, group_id))
    assert not [pid for pid in (a["pid"] for a in ranks) if running(pid)]
    # The supervisor starts it again: new placement group, three new rank actors.
    deadline = time.monotonic() + 90
    while server.get("/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.get("/health").status_code == 200, server.log()
    fresh = our_group(ray_cluster)["placement_group_id"]
    assert fresh != group_id
    assert [a["state"] for a in rank_actors(ray_cluster, fresh)] == ["ALIVE"] * 3
    client = server.openai()
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert result.choices[0].text == greedy[0]


class _Driver:
    """Stands in for an instance actor: owns a rank actor, as RayRanks makes it."""

    def start_rank(self) -> int:
        import ray

        from pdserve.cluster.ray_ranks import TensorParallelRank

        self.rank = ray.remote(TensorParallelRank).options(num_cpus=0).remote("orphan-test")
        return ray.get(self.rank.pid.remote())

    def pid(self) -> int:
        return os.getpid()


def test_rank_actors_die_with_their_driver_actor(ray_cluster) -> None:
    import ray  # the session fixture's connection

    driver = ray.remote(_Driver).options(num_cpus=0).remote()
    rank_pid = ray.get(driver.start_rank.remote(), timeout=60)
    assert running(rank_pid)
    os.kill(ray.get(driver.pid.remote(), timeout=30), signal.SIGKILL)
    assert not still_running([rank_pid], 20), "a rank actor outlived its driver"
