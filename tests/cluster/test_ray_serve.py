"""`pdserve serve --launcher ray` joining a Ray cluster that the test session owns: colocated
instances, then one prefill and one decode instance (role-neutral `Instance` actors, as
their role can change), whose prefill instance switches to decode and back in place:
the same actor, the same process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from experiments.serving import ADMIN_KEY, MODEL, ServeProcess, pool, served, wait_for
from tests.cluster.conftest import RAY_ENV, ray_list

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(ray_cluster: str) -> Iterator[ServeProcess]:
    with served(
        "--mode", "colocated", "--launcher", "ray", "--ray-address", ray_cluster,
        "--num-colocated", "2", "--dtype", "float32", "--kv-cache-memory", "64MiB",
        "--max-model-len", "1024",
        "--threads-per-instance", "1", "--enable-test-hooks", env=RAY_ENV,
    ) as process:  # fmt: skip
        yield process


def ray_actors(address: str) -> list[dict]:
    return ray_list("actors", address)


def test_serves_through_ray_actors(server, ray_cluster) -> None:
    result = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    assert result.usage.completion_tokens >= 1
    alive = [a for a in ray_actors(ray_cluster) if a["state"] == "ALIVE"]
    mine = sorted(
        (a for a in alive if a["class_name"] == "ColocatedInstance"), key=lambda a: a["name"]
    )
    assert [a["name"] for a in mine] == ["colocated-0", "colocated-1"]
    pid = server.instances()["colocated-0"]["pid"]
    assert mine[0]["pid"] == pid
    title = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True)
    assert "ray::ColocatedInstance" in title.stdout
    # Not Ray's worker niceness (15): the gateway and the client would preempt its steps.
    assert os.getpriority(os.PRIO_PROCESS, pid) == 0
    server.assert_blocks_free_or_cached()


def test_a_dead_actor_is_noticed_and_the_other_serves_on(server) -> None:
    pid = server.instances()["colocated-0"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server.instances()["colocated-0"]["alive"] and time.monotonic() < deadline:
        time.sleep(0.3)
    assert server.instances()["colocated-0"]["alive"] is False
    result = server.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert result.usage.completion_tokens >= 1


def test_sigterm_shuts_down_and_leaves_the_joined_cluster_running(server, ray_cluster) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    survivor = {a["name"]: a["state"] for a in ray_actors(ray_cluster)}["colocated-1"]
    assert survivor == "ALIVE"
    assert server.stop(timeout_s=60) == 0
    ours = [a for a in ray_actors(ray_cluster) if a["class_name"] == "ColocatedInstance"]
    # colocated-0 twice: the killed actor and the one the supervisor started again
    assert {a["name"] for a in ours} == {"colocated-0", "colocated-1"}
    assert all(a["state"] == "DEAD" for a in ours)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
    import ray

    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2


# ---- disaggregated: the same cluster, once the colocated server above is gone ---------


@pytest.fixture(scope="module")
def pd_server(ray_cluster: str) -> Iterator[ServeProcess]:
    with served(
        "--launcher", "ray", "--ray-address", ray_cluster, "--num-prefill", "1",
        "--num-decode", "1", "--dtype", "bfloat16", "--kv-cache-memory", "64MiB",
        "--max-model-len", "1024", "--max-pool-size", "2",
        "--threads-per-instance", "1", "--enable-test-hooks", env=RAY_ENV,
        exit_zero=True, stop_timeout_s=60,
    ) as process:  # fmt: skip
        yield process


def test_prefill_and_decode_instances_are_ray_actors(pd_server, ray_cluster) -> None:
    result = pd_server.openai().completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert result.usage.completion_tokens == 4
    alive = {a["name"]: a for a in ray_actors(ray_cluster) if a["state"] == "ALIVE"}
    assert alive["prefill-0"]["class_name"] == "Instance"
    assert alive["decode-0"]["class_name"] == "Instance"
    found = pd_server.instances()
    for name in ("prefill-0", "decode-0"):
        assert alive[name]["pid"] == found[name]["pid"]
        title = subprocess.run(
            ["ps", "-o", "args=", "-p", str(found[name]["pid"])], capture_output=True, text=True
        )
        assert "ray::Instance" in title.stdout
    metrics = pd_server.get("/metrics").text  # the tokens after the first came through a pull
    assert 'pdserve:kv_transfer_blocks_total{instance="decode-0",role="decode"} 1.0' in metrics
    assert 'pdserve:generation_tokens_total{instance="decode-0",role="decode"} 3.0' in metrics
    pd_server.assert_blocks_free_or_cached()


def test_a_prefill_actor_switches_to_decode_and_back_in_place(pd_server, ray_cluster) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    pid = pd_server.instances()["prefill-0"]["pid"]
    expected = complete(pd_server)
    for role in ("decode", "prefill"):
        asked = pd_server.post("/admin/instances/prefill-0/role", json={"role": role},
                               headers=admin)  # fmt: skip
        assert asked.status_code == 202, asked.text
        wait_for(lambda r=role: "prefill-0" in pool(pd_server, r), 60, f"prefill-0 as {role}")
        assert complete(pd_server) == expected  # whole on decode instances, then split
        assert pd_server.instances()["prefill-0"]["pid"] == pid  # the same process
    alive = {a["name"]: a for a in ray_actors(ray_cluster) if a["state"] == "ALIVE"}
    assert alive["prefill-0"]["pid"] == pid and alive["prefill-0"]["class_name"] == "Instance"
    metrics = pd_server.get("/metrics").text
    assert 'pdserve:role_switches_total{from="prefill",to="decode"} 1.0' in metrics
    assert 'pdserve:instance_role{instance="prefill-0",role="prefill"} 1.0' in metrics
    pd_server.assert_blocks_free_or_cached()


def complete(server: ServeProcess) -> str:
    result = server.openai().completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return result.choices[0].text
