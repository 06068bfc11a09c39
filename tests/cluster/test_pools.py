"""Pools scaled without processes: a scale-up answers at once and its instances reach
the launcher on a bounded pool of threads (never one per instance, under either
launcher's path); a pool never grows past its `--max-pool-size`, whose default is what
the cores and GPUs hold of the pool's instances."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.cli import build_parser
from pdserve.cluster import ray_watch
from pdserve.cluster.deployment import Deployment, ServeError
from pdserve.cluster.placement import PlannedInstance, pool_capacity
from pdserve.cluster.pools import START_WORKERS, Pools
from pdserve.cluster.supervisor import Supervisor
from pdserve.instance.spec import InstanceSpec
from tests.cluster.processless import ProcesslessLauncher


def spec(instance_id: str) -> InstanceSpec:
    return InstanceSpec(instance_id=instance_id, role=instance_id.split("-")[0],
                        gateway_address="tcp://g:1")  # fmt: skip


class SlowLauncher(ProcesslessLauncher):
    """Each start takes a while (a process spawned); records how many ran at once."""

    can_start = True

    def __init__(self, start_s: float = 0.05) -> None:
        super().__init__()
        self.start_s = start_s
        self.started: list[str] = []
        self.threads: set[str] = set()
        self.running = self.most_running = 0
        self._lock = threading.Lock()

    def start_instance(self, spec, on_ready) -> bool:
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.threads.add(threading.current_thread().name)
        time.sleep(self.start_s)
        with self._lock:
            self.running -= 1
            self.started.append(spec.instance_id)
        return True


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_scale_up_answers_at_once_and_starts_on_a_bounded_pool() -> None:
    launcher = SlowLauncher()
    supervisor = Supervisor(launcher, [spec("prefill-0"), spec("decode-0")], lambda info: None)
    pools = Pools(launcher, supervisor, lambda info: None, {"decode": 25})
    threads_before = threading.active_count()
    began = time.monotonic()
    started = pools.start("decode", 24)
    assert time.monotonic() - began < 0.05 * 2  # not 24 starts of 0.05 s each
    assert started == [f"decode-{i}" for i in range(1, 25)]
    assert pools.members("decode") == ["decode-0", *started]  # members from the answer on
    assert threading.active_count() - threads_before <= START_WORKERS
    wait_until(lambda: len(launcher.started) == 24)
    assert sorted(launcher.started) == sorted(started)
    assert launcher.most_running <= START_WORKERS and len(launcher.threads) <= START_WORKERS
    pools.close()


def test_a_pool_never_grows_past_its_max_size() -> None:
    launcher = SlowLauncher(start_s=0.0)
    supervisor = Supervisor(launcher, [spec("decode-0")], lambda info: None)
    pools = Pools(launcher, supervisor, lambda info: None, {"decode": 3})
    assert pools.max_size("decode") == 3 and pools.max_size("prefill") is None
    with pytest.raises(ValueError, match="at most 3"):
        pools.start("decode", 3)
    assert pools.members("decode") == ["decode-0"]
    assert pools.start("decode", 2) == ["decode-1", "decode-2"]
    with pytest.raises(ValueError, match="--max-pool-size"):
        pools.start("decode", 1)
    pools.close()


def test_an_instance_drained_before_its_turn_never_starts() -> None:
    launcher = SlowLauncher(start_s=0.1)
    supervisor = Supervisor(launcher, [spec("decode-0")], lambda info: None)
    pools = Pools(launcher, supervisor, lambda info: None)
    started = pools.start("decode", START_WORKERS + 1)
    pools.retire(started[-1])  # still queued behind the others
    wait_until(lambda: len(launcher.started) == START_WORKERS)
    time.sleep(0.2)
    assert started[-1] not in launcher.started
    pools.close()


class BlockingRayLauncher:
    """What `ActorWatch` uses of the Ray launcher, with actors whose creation blocks
    (a placement group waiting for room) until `release`."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.release = threading.Event()
        self.actors: dict[str, object] = {}
        self.placement_groups: dict[str, list] = {}
        self.created: list[str] = []

    def inherit_share(self, spec: InstanceSpec) -> None: ...

    def create_actor(self, spec: InstanceSpec) -> object:
        self.release.wait(10)
        self.created.append(spec.instance_id)
        return FakeActor()

    def _ray(self):
        return self


class FakeActor:
    class load:  # noqa: N801 - Ray's `actor.load.remote()`
        @staticmethod
        def remote() -> object:
            return object()


def test_ray_actors_are_created_on_a_bounded_pool_never_a_thread_each() -> None:
    launcher = BlockingRayLauncher()
    watch = ray_watch.ActorWatch(launcher)  # type: ignore[arg-type]
    threads_before = threading.active_count()
    began = time.monotonic()
    for index in range(40):
        assert watch.start_instance(spec(f"decode-{index}"), lambda info: None)
    assert time.monotonic() - began < 1.0
    assert threading.active_count() - threads_before <= ray_watch.CREATE_WORKERS
    launcher.release.set()
    wait_until(lambda: len(launcher.created) == 40)
    assert set(launcher.actors) == {f"decode-{i}" for i in range(40)}
    launcher.stopping.set()
    watch.join()


def planned(role: str, cpus: float, gpus: float = 0.0) -> PlannedInstance:
    return PlannedInstance(f"{role}-0", role, 1, [], cpus, num_gpus=gpus)


def test_pool_capacity_is_what_the_cores_and_gpus_hold() -> None:
    assert pool_capacity([planned("prefill", 2.0), planned("decode", 2.0)], 16, 0) == {
        "prefill": 8, "decode": 8}  # fmt: skip
    # A tensor-parallel instance of 3 GPUs on 8 GPUs: 2 fit.
    assert pool_capacity([planned("decode", 3.0, 3.0)], 64, 8) == {"decode": 2}
    # Never below what is planned (instances crowded onto fewer cores).
    crowded = [planned("decode", 0.5)] * 5
    assert pool_capacity(crowded, 2, 0) == {"decode": 5}


def plan(*argv: str) -> Deployment:
    return Deployment.from_args(build_parser().parse_args(["serve", *argv]), cores=[0, 1])


def test_max_pool_size_defaults_from_the_cores_and_can_be_set() -> None:
    # 1 prefill + 2 decode instances on 2 cores: 2/3 of a core each, 3 fit per pool.
    assert plan("--num-decode", "2").max_pool_sizes == {"prefill": 3, "decode": 3}
    assert plan("--max-pool-size", "8").max_pool_sizes == {"prefill": 8, "decode": 8}
    with pytest.raises(ServeError, match="--max-pool-size 1 is below the 2 decode"):
        plan("--num-decode", "2", "--max-pool-size", "1")
