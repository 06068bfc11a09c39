"""A worker group's ranks as Ray actors: the Ray `RankLauncher` (engine/ranks.py).

Placement: a tensor-parallel instance reserves one STRICT_PACK placement group per
pipeline stage (`reserve_rank_groups`; a TP group's ranks talk over loopback, stages may
land on different nodes), one bundle per rank asking for the rank's share of the
instance's CPUs (fractional where ranks share cores), one whole GPU when the instance
uses GPUs (the rank's `cuda:0`: `engine/devices.py`), and the pool's custom resources.
The instance's actor (the group's driver: step loop and scheduler) sits in bundle 0 of
stage 0 asking for nothing, so rank 0 is on the driver's node, which serves the
group's rendezvous store (`engine/rendezvous.py:Rendezvous`). Rank r runs in bundle
r % tp of stage r // tp's group.

Channel: each rank actor connects a ZMQ DEALER to a ROUTER the driver binds (on
loopback when the group is one stage, whose ranks share the driver's node; else on the
node's address), and the same small encoded plans and results as the pipes cross it,
every frame sealed on the `ranks` channel under the rank's name (`common/frame_seal.py`):
the driver opens a rank's frame only under its routing identity and drops (and counts)
whatever fails or has the wrong shape, so no stranger's frame ends the group or pairs a
step with stale replies. A rank's DEALER hears only its driver, so a frame that fails
there means another secret: the rank ends, naming it. No tensor is pickled and Ray
carries no per-step call. Death: each rank's long-running `serve()`
call completes only when its rank loop ends or its actor dies (ray.kill, its process
killed, its node lost: RayActorError, ActorUnavailableError first for a lost node), so
a thread waiting on those calls ends the group at once. Rank actors are owned by the
instance's actor: Ray kills them when it dies, and the group kills them when it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading

import msgspec
import zmq

from pdserve.cluster.actor_env import engine_runtime_env
from pdserve.cluster.addresses import LOOPBACK, node_host
from pdserve.cluster.launcher import LaunchError
from pdserve.cluster.ray_cluster import one_line, ray_module
from pdserve.common import frame_drops
from pdserve.common.frame_seal import RANKS, Sealer
from pdserve.common.wire_auth import SECRET_ENV
from pdserve.engine.devices import own_gpu_devices
from pdserve.engine.ranks import RankGroup, RankJob, WorkerGroupFailed

logger = logging.getLogger(__name__)

POLL_MS = 50  # how often a waiting driver looks at the death flag between frames
DRIVER = "driver"  # the name the driver seals under (a rank's is its number)
PID_TIMEOUT_S = 30.0


def group_name(instance_id: str, stage: int) -> str:
    return f"{instance_id}-ranks" if stage == 0 else f"{instance_id}-ranks-stage{stage}"


def reserve_rank_groups(
    instance_id: str, ranks: int, stages: int, bundle: dict[str, float], timeout_s: float
) -> list:
    """One STRICT_PACK placement group of `ranks // stages` bundles per stage, ready."""
    ray = ray_module()
    from ray.util.placement_group import placement_group, remove_placement_group

    per_stage = ranks // stages
    groups = [
        placement_group(
            [dict(bundle) for _ in range(per_stage)],
            strategy="STRICT_PACK",
            name=group_name(instance_id, stage),
        )
        for stage in range(stages)
    ]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=stages, timeout=timeout_s)
    if len(ready) < stages:
        for group in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        raise LaunchError(
            f"{instance_id}: no node has room for its {per_stage} rank bundles {bundle}"
            + (f" (x{stages} stages)" if stages > 1 else "")
        )
    return groups


def driver_options(groups: list) -> dict:
    """The instance actor's options: beside rank 0, asking for nothing of its own."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(groups[0], placement_group_bundle_index=0)
    return {"num_cpus": 0, "num_gpus": 0, "scheduling_strategy": strategy}


def rank_options(bundle: dict[str, float]) -> dict:
    """A rank actor asks for all of its bundle: CPUs, its GPU, custom resources."""
    shape = dict(bundle)
    return {"num_cpus": shape.pop("CPU", 0), "num_gpus": shape.pop("GPU", 0), "resources": shape}


class TensorParallelRank:
    """One rank of a worker group (what `ray list actors` shows, with its repr)."""

    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return self.label

    def serve(self, job: RankJob, driver: str) -> None:
        """The rank's whole life; returns when the driver says stop."""
        from pdserve.engine.worker_group import run_rank

        channel = SealedChannel(driver, job.rank)
        try:
            run_rank(on_this_node(job), channel)
        finally:
            channel.close()

    def pid(self) -> int:
        return os.getpid()


def on_this_node(job: RankJob) -> RankJob:
    """The job as this rank must run it where Ray placed it: a rank on another node than
    its driver (a pipeline stage placed elsewhere) binds and advertises its KV connector
    on its own node's address, not the driver's."""
    # Imported here: the launcher's process (the gateway's) never builds a connector.
    from pdserve.kvtransfer.connector import TransferConnectorFactory

    factory = job.connector
    if not isinstance(factory, TransferConnectorFactory) or factory.config.host == LOOPBACK:
        return job  # one machine, or no KV to move: everything on loopback
    config = factory.config
    here = node_host()
    if here == config.host:
        return job
    moved = dataclasses.replace(factory, config=msgspec.structs.replace(config, host=here))
    return dataclasses.replace(job, connector=moved)


class SealedChannel:
    """A rank's end: a DEALER to the driver's ROUTER, every frame sealed."""

    def __init__(self, driver: str, rank: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, str(rank).encode())
        self.socket.setsockopt(zmq.MAXMSGSIZE, RANKS.max_message_bytes)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.connect(driver)
        self.sealer = Sealer(RANKS, str(rank), name=f"rank {rank}")

    def send_bytes(self, data: bytes) -> None:
        self.socket.send(self.sealer.seal(data), copy=False)

    def recv_bytes(self) -> bytes:
        opened = self.sealer.open(self.socket.recv(), "the group's driver", sender=DRIVER)
        if opened is None:
            # Only the driver reaches this DEALER: its frame failing means another secret.
            raise RuntimeError(
                f"frames from the worker group's driver fail the deployment secret check "
                f"(is {SECRET_ENV} the same on every node?)"
            )
        return opened.payload

    def close(self) -> None:
        self.socket.close()
        self.context.term()


class RayRanks:
    """Starts each rank as a `TensorParallelRank` actor in its bundle."""

    def __init__(self, host: str, instance_id: str, stages: int = 1) -> None:
        self.host = host  # this node's address: the group's when its stages may spread
        self.instance_id = instance_id
        self.stages = stages

    def group_host(self) -> str:
        """The interface the group's sockets bind: loopback for one stage (its STRICT_PACK
        placement group holds the driver too), else the node's address."""
        return LOOPBACK if self.stages == 1 else self.host

    def master_host(self) -> str:
        return self.group_host()

    def devices(self, size: int, device: str) -> list[str]:
        return own_gpu_devices(device, size)  # Ray shows each rank actor its one GPU

    def start(self, jobs: list[RankJob]) -> RankGroup:
        ray = ray_module()
        from ray.util import get_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        groups = [get_placement_group(group_name(self.instance_id, s)) for s in range(self.stages)]
        per_stage = len(jobs) // self.stages
        group = RayRankGroup(self.group_host())
        rank_class = ray.remote(TensorParallelRank)
        for job in jobs:
            placement = groups[job.rank // per_stage]
            index = job.rank % per_stage
            actor = rank_class.options(
                **rank_options(placement.bundle_specs[index]),
                max_restarts=0,
                max_concurrency=2,  # serve() holds one thread; pid() takes the other
                # The secret's file, never the secret: Ray's state API shows this.
                runtime_env=engine_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=index
                ),
            ).remote(f"{self.instance_id}-rank-{job.rank}")
            group.add(actor, actor.serve.remote(job, group.address))
        group.watch()
        return group


class RayRankGroup:
    """The driver's end: one ROUTER for every rank, and a thread watching the actors."""

    def __init__(self, host: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone rank raises
        self.socket.setsockopt(zmq.MAXMSGSIZE, RANKS.max_message_bytes)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.sealer = Sealer(RANKS, DRIVER, responder=True, name="worker group driver")
        self.actors: list = []
        self.serving: dict = {}  # each rank's serve() call → its rank
        self.dead: tuple[int, str] | None = None
        self._death = threading.Event()  # set when a rank died or the group closed
        self._closed = False
        self._lock = threading.Lock()  # the socket: the step thread and shutdown
        self._pids: list[int | None] = []

    def add(self, actor, serving) -> None:
        self.serving[serving] = len(self.actors)
        self.actors.append(actor)

    def watch(self) -> None:
        threading.Thread(target=self._watch, name="tp-ray-ranks-watch", daemon=True).start()

    def _watch(self) -> None:
        ray = ray_module()
        pending = list(self.serving)
        while not self._closed:
            done, _ = ray.wait(pending, num_returns=1, timeout=0.5)
            if done and not self._closed:
                self.dead = self.serving[done[0]], self._why(done[0])
                self._death.set()
                return

    def _why(self, serving) -> str:
        ray = ray_module()
        from ray.exceptions import ActorUnavailableError, RayActorError

        try:
            ray.get(serving, timeout=5)
            return "its rank loop ended"
        except ActorUnavailableError as exc:
            return f"its actor is unreachable, its node lost? {one_line(exc)}"
        except RayActorError as exc:
            return f"its actor died: {one_line(exc)}"
        except Exception as exc:  # the rank raised before it could report
            return one_line(exc)

    # ---- RankGroup ----------------------------------------------------------------------

    def send(self, rank: int, data: bytes) -> None:
        self._raise_if_dead()
        try:
            with self._lock:
                self.socket.send_multipart([str(rank).encode(), self.sealer.seal(data)])
        except zmq.ZMQError as exc:
            reason = f"rank {rank} of the worker group is unreachable: {exc}"
            raise WorkerGroupFailed(reason) from None

    def receive(self, waiting: set[int]) -> list[tuple[int, bytes]]:
        while True:
            self._raise_if_dead()
            replies = []
            with self._lock:
                if self.socket.poll(POLL_MS):
                    while self.socket.poll(0):
                        replies.extend(self.open(self.socket.recv_multipart()))
            if replies:
                return replies

    def open(self, message: list[bytes]) -> list[tuple[int, bytes]]:
        """A rank's reply, checked: sealed under the rank its routing identity names, and
        in shape. Anything else is dropped and counted; the group goes on."""
        if len(message) != 2:
            self.sealer.refuse(frame_drops.MALFORMED, "the ranks' socket")
            return []
        identity, frame = message
        name = identity.decode(errors="replace")
        if not name.isdigit() or int(name) >= len(self.actors):
            # Sized first, as every frame is: one past the limit counts as `oversized`.
            too_large = self.sealer.too_large(len(frame))
            reason = frame_drops.OVERSIZED if too_large else frame_drops.IDENTITY
            self.sealer.refuse(reason, f"a peer named {name!r}")
            return []
        opened = self.sealer.open(frame, f"rank {name}", sender=name)
        return [] if opened is None else [(int(name), opened.payload)]

    def _raise_if_dead(self) -> None:
        if self.dead is not None:
            rank, why = self.dead
            raise WorkerGroupFailed(f"rank {rank} of the worker group died ({why})")

    def wait_for_death(self) -> tuple[int, str] | None:
        self._death.wait()
        return None if self._closed else self.dead

    def pids(self) -> list[int | None]:
        if not self._pids:
            ray = ray_module()
            self._pids = ray.get([a.pid.remote() for a in self.actors], timeout=PID_TIMEOUT_S)
        return self._pids

    def close(self, timeout_s: float) -> None:
        self._closed = True
        self._death.set()
        ray_module().wait(list(self.serving), num_returns=len(self.serving), timeout=timeout_s)
        self.kill()
        with self._lock:
            self.socket.close()
            self.context.term()

    def kill(self) -> None:
        ray = ray_module()
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
