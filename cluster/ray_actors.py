"""Instance kinds as Ray actors. The class names are what `ray list actors` and `ps`
show (Ray titles an actor's process `ray::ColocatedInstance`); each actor is also
named after its instance id. An instance that moves KV may change role in place
(`instance/role_switch.py`), so its class says no role: `Instance` (its current role
is in `/health` and `/metrics`); only a colocated instance without KV transfer
(`--mode colocated`) keeps its role for life and says so.

The step loop is imported inside the actor, so the driver (the gateway process) never
loads torch. Ray runs the methods on a small thread pool: `run()` holds one thread
while `stop()` and `ping()` use the others. The weights load and the steps run on one
engine thread of the actor's own: each thread that starts OpenMP work gets a team of
its own, and once a process holds more team threads than cores, libgomp's idle threads
sleep almost at once instead of spinning, so every parallel region waits for a wake-up
(measured: 29 ms a token against 20 ms at batch 1, two threads on two cores).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import msgspec

from pdserve.cluster.addresses import resolve_host
from pdserve.instance.spec import InstanceSpec, moves_kv


class RemoteMethod(Protocol):
    def remote(self, *args: Any) -> Any: ...  # a Ray ObjectRef


class InstanceHandle(Protocol):
    """The launcher's Ray handle to an instance actor: each method called as `.remote()`."""

    load: RemoteMethod
    run: RemoteMethod
    stop: RemoteMethod


class _InstanceActor:
    def __init__(self, spec_json: bytes) -> None:
        from pdserve.cluster.ray_ranks import RayRanks
        from pdserve.instance.loop import StepLoop

        spec = msgspec.json.decode(spec_json, type=InstanceSpec)
        # On a cluster the spec names no address: this node's is only known here.
        spec = msgspec.structs.replace(spec, host=resolve_host(spec.host))
        # A worker group's ranks are actors of their own, in the bundles the launcher
        # reserved (unused by an instance of one rank).
        ranks = RayRanks(spec.host, spec.instance_id, spec.engine.pipeline_parallel_size)
        self.loop = StepLoop(spec, ranks=ranks)
        self.engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def load(self) -> bytes:
        """Loads the weights; returns the InstanceInfo as JSON."""
        return msgspec.json.encode(self.engine.submit(self.loop.load).result())

    def run(self) -> str | None:
        """Returns when the loop ends: None after `stop()`, else why it ended."""
        return self.engine.submit(self.loop.run).result()

    def stop(self) -> None:
        self.loop.stop()

    def ping(self) -> str:
        return "ok"


class ColocatedInstance(_InstanceActor):
    """Runs whole requests, prompt and every output token, for life (`--mode colocated`)."""


class Instance(_InstanceActor):
    """A prefill, decode or colocated instance, whichever it serves as now: one that
    moves KV can switch roles without leaving its actor."""


def actor_class(spec: InstanceSpec) -> type[_InstanceActor]:
    """The class `ray list actors` shows: role-neutral where the role can change."""
    return Instance if moves_kv(spec) else ColocatedInstance
