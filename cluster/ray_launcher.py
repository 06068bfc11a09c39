"""The Ray launcher: instances as named actors in a Ray cluster (started here, or joined
with `--ray-address`), each asking for its share of the CPUs (and of a GPU: Ray then
sets the actor's CUDA_VISIBLE_DEVICES) and the custom resources of its pool
(`--prefill-resources` ...), which pin pools to nodes. The deployment secret reaches
every actor as a private file on its node (`cluster/secret_file.py`): its `runtime_env`
(`cluster/actor_env.py`), which Ray's state API shows, names only the file, and sets
Ray's worker niceness to 0 (engine steps do not yield to the gateway).

Readiness: every actor's `load()` is awaited, with progress while weights load. Health:
each actor's long-running `run()` call finishes only if the step loop ends or the actor
dies, so waiting on those calls is the death watch (`cluster/ray_watch.py`, which also
starts, stops and kills single actors after the launch). Shutdown asks every step loop to
stop, waits a little, then kills the actors (their ports close with their processes);
a cluster started here is shut down too.
"""

from __future__ import annotations

import contextlib

import msgspec

from pdserve.cluster.actor_env import engine_runtime_env
from pdserve.cluster.launcher import (
    STOP_GRACE_S,
    ExitCallback,
    Launcher,
    LaunchError,
    ReadyCallback,
)
from pdserve.cluster.ray_actors import InstanceHandle
from pdserve.cluster.ray_actors import actor_class as actor_class_of
from pdserve.cluster.ray_cluster import join, one_line, ray_module
from pdserve.cluster.ray_ranks import driver_options, reserve_rank_groups
from pdserve.cluster.ray_watch import ActorWatch
from pdserve.common.messages import InstanceInfo
from pdserve.instance.spec import InstanceSpec


class RayLauncher(Launcher):
    can_start = True

    def __init__(
        self,
        address: str | None = None,
        namespace: str = "pdserve",
        num_cpus: dict[str, float] | None = None,
        num_gpus: dict[str, float] | None = None,
        ready_timeout_s: float = 600.0,
        resources: dict[str, dict[str, float]] | None = None,
    ) -> None:
        """`resources`: Ray custom resources per role, asked by each of its actors."""
        super().__init__(ready_timeout_s)
        self.address = address
        self.namespace = namespace
        self.num_cpus = num_cpus or {}
        self.num_gpus = num_gpus or {}
        self.resources = resources or {}
        self.actors: dict[str, InstanceHandle] = {}
        self.run_refs: dict[object, str] = {}
        self.started_cluster = False
        self.placement_groups: dict[str, list] = {}  # instance id → its stages' groups
        self.actor_watch = ActorWatch(self)

    def _ray(self):
        return ray_module()

    def connect(self) -> None:
        self.started_cluster = join(self.address, self.namespace) or self.started_cluster

    def launch(self, specs: list[InstanceSpec], on_ready: ReadyCallback) -> None:
        ray = self._ray()
        self.connect()
        loads = {}
        # The secret's file, never the secret: `ray list actors --detail` shows this.
        runtime_env = engine_runtime_env()
        for spec in specs:
            try:
                actor = self.create_actor(spec, runtime_env)
            except ValueError as exc:  # a name already taken in this namespace
                raise LaunchError(f"cannot create actor {spec.instance_id}: {exc}") from None
            self.actors[spec.instance_id] = actor
            loads[actor.load.remote()] = spec.instance_id
        loading = self.loading(len(specs))
        cause = " (not enough CPUs, GPUs or custom resources in the cluster?)"
        while loads:
            loading.check(loads.values(), cause)
            ready, _ = ray.wait(list(loads), num_returns=1, timeout=0.5)
            for ref in ready:
                instance_id = loads.pop(ref)
                try:
                    info = msgspec.json.decode(ray.get(ref), type=InstanceInfo)
                except Exception as exc:
                    raise LaunchError(f"{instance_id} failed to start: {one_line(exc)}") from None
                loading.ready(instance_id, info, on_ready)
                self.run_refs[self.actors[instance_id].run.remote()] = instance_id

    def create_actor(self, spec: InstanceSpec, runtime_env: dict | None = None) -> InstanceHandle:
        """The instance's actor, named after it (ValueError: the name is taken)."""
        if runtime_env is None:
            runtime_env = engine_runtime_env()
        actor_class = self._ray().remote(actor_class_of(spec))
        return actor_class.options(
            name=spec.instance_id,
            runtime_env=runtime_env,
            max_concurrency=4,
            max_restarts=0,
            **self._placement(spec),
        ).remote(msgspec.json.encode(spec))

    def inherit_share(self, spec: InstanceSpec) -> None:
        """An instance added to a pool asks for what the pool's first one asks."""
        for shares in (self.num_cpus, self.num_gpus):
            if spec.instance_id not in shares:
                same = sorted(i for i in shares if i.rsplit("-", 1)[0] == spec.role)
                if same:
                    shares[spec.instance_id] = shares[same[0]]

    def resources_of(self, role: str) -> dict[str, float]:
        return dict(self.resources.get(role, {}))

    def _placement(self, spec: InstanceSpec) -> dict:
        """The actor's resources. A tensor-parallel instance runs each rank as an actor
        of its own (cluster/ray_ranks.py): it reserves a STRICT_PACK placement group per
        stage of one bundle per rank (its share of the CPUs, one whole GPU when it uses
        GPUs, and the pool's custom resources each), and its actor sits beside rank 0
        asking nothing."""
        cpus = self.num_cpus.get(spec.instance_id, 1.0)
        gpus = self.num_gpus.get(spec.instance_id, 0.0)
        custom = self.resources.get(spec.role, {})
        stages = spec.engine.pipeline_parallel_size
        ranks = spec.engine.world_size
        if ranks <= 1:
            return {"num_cpus": cpus, "num_gpus": gpus, "resources": custom}
        if gpus and gpus != ranks:
            raise LaunchError(
                f"{spec.instance_id}: {gpus:g} GPUs for {ranks} ranks; each rank asks Ray for "
                f"one whole GPU (a share could put two ranks of {spec.instance_id} on one GPU, "
                "which NCCL refuses)"
            )
        bundle = {"CPU": cpus / ranks, **({"GPU": 1.0} if gpus else {}), **custom}
        groups = reserve_rank_groups(spec.instance_id, ranks, stages, bundle, self.ready_timeout_s)
        self.placement_groups[spec.instance_id] = groups
        return driver_options(groups)

    # ---- after the launch: cluster/ray_watch.py -----------------------------------------

    def watch(self, on_exit: ExitCallback) -> None:
        self.actor_watch.start(on_exit)

    def start_instance(self, spec: InstanceSpec, on_ready: ReadyCallback) -> bool:
        return self.actor_watch.start_instance(spec, on_ready)

    def stop_instance(self, instance_id: str) -> bool:
        return self.actor_watch.stop_instance(instance_id)

    def kill_instance(self, instance_id: str) -> bool:
        return self.actor_watch.kill_instance(instance_id)

    def shutdown(self) -> None:
        self.stopping.set()
        ray = self._ray()
        if not ray.is_initialized():
            return
        for actor in list(self.actors.values()):
            with contextlib.suppress(Exception):  # already dead
                actor.stop.remote()
        if self.run_refs:
            ray.wait(list(self.run_refs), num_returns=len(self.run_refs), timeout=STOP_GRACE_S)
        for actor in list(self.actors.values()):
            with contextlib.suppress(Exception):
                ray.kill(actor)
        for groups in list(self.placement_groups.values()):
            for group in groups:
                with contextlib.suppress(Exception):
                    ray.util.remove_placement_group(group)
        self.actor_watch.join()
        # Stops a cluster started here; only disconnects from one joined with --ray-address.
        ray.shutdown()
