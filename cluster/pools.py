"""The cluster's side of `/admin/*` (`gateway/admin.py`'s `PoolControl`): which
instances a pool has, how large it may grow, more started, one drained stopped for good.

A pool's members are the supervisor's: planned or added, loaded or loading, not
retired. One more instance is a copy of the pool's first planned spec under the next
unused id (`decode-2`, ...; an id is never reused, so no retired epoch can be mistaken
for a new life): on the same cores and GPU with the local launcher (scaling up on a GPU
needs room planned for it), with the same resource request under Ray (the actor waits
until a node has room).

`start` answers at once: the new instances are the supervisor's members from then on,
and `START_WORKERS` threads hand them to the launcher a few at a time (a process
spawned, an actor queued for creation), never on the gateway's event loop and never a
thread per instance. A pool never grows past its `--max-pool-size`.

A switch moves an instance between pools in place (`gateway/role_switch.py`): `fit`
says whether its configuration suits the other pool (TP and PP sizes, model, dtype,
quantization, KV cache dtype, device, block size, the pool's Ray resources, the pool's size
cap); `move` makes the supervisor keep it, and restart it, in the new pool.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import msgspec

from pdserve.cluster.launcher import Launcher, ReadyCallback
from pdserve.cluster.supervisor import Supervisor
from pdserve.instance.spec import InstanceSpec, moves_kv

logger = logging.getLogger(__name__)

START_WORKERS = 2
# What an instance must share with a pool's planned instances to join it.
FITTING = (
    "model",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "calculate_kv_scales",
    "device",
    "block_size",
)


def index_of(instance_id: str) -> int:
    """`decode-3` → 3 (ids are "<role>-<n>")."""
    suffix = instance_id.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else 0


def _unlike(spec: InstanceSpec, template: InstanceSpec) -> tuple[str, object, object] | None:
    """The first setting of `FITTING` the two engines differ in, with both values."""
    for name in FITTING:
        mine, theirs = getattr(spec.engine, name), getattr(template.engine, name)
        if mine != theirs:
            return name, mine, theirs
    return None


class Pools:
    def __init__(
        self,
        launcher: Launcher,
        supervisor: Supervisor,
        on_ready: ReadyCallback,
        max_sizes: dict[str, int] | None = None,
    ) -> None:
        """`max_sizes`: the largest size of each pool (absent: no limit)."""
        self.launcher = launcher
        self.supervisor = supervisor
        self.on_ready = on_ready
        self.max_sizes = dict(max_sizes or {})
        self._starter = ThreadPoolExecutor(START_WORKERS, thread_name_prefix="pool-start")
        self._templates: dict[str, InstanceSpec] = {}
        self._next: dict[str, int] = {}
        for spec in sorted(supervisor.specs.values(), key=lambda s: index_of(s.instance_id)):
            self._templates.setdefault(spec.role, spec)
            self._next[spec.role] = max(
                self._next.get(spec.role, 0), index_of(spec.instance_id) + 1
            )

    def members(self, role: str) -> list[str]:
        ids = [i for i, spec in self.supervisor.specs.items() if spec.role == role]
        return sorted(ids, key=index_of)

    def max_size(self, role: str) -> int | None:
        return self.max_sizes.get(role)

    def start(self, role: str, count: int) -> list[str]:
        """The ids of `count` more instances of the pool, at once; the launcher gets
        them on the starter's threads."""
        template = self._templates.get(role)
        if template is None:
            raise ValueError(f"this deployment has no {role} pool")
        if not self.launcher.can_start:
            raise ValueError("this launcher cannot start instances")
        limit = self.max_size(role)
        if limit is not None and len(self.members(role)) + count > limit:
            raise ValueError(f"the {role} pool may hold at most {limit} (--max-pool-size)")
        started = []
        for _ in range(count):
            instance_id = f"{role}-{self._next[role]}"
            spec = msgspec.structs.replace(template, instance_id=instance_id, epoch=0)
            self._next[role] += 1
            self.supervisor.add(spec)
            self._starter.submit(self._start_one, spec)
            started.append(instance_id)
        return started

    def _start_one(self, spec: InstanceSpec) -> None:
        if not self.supervisor.knows(spec.instance_id):
            return  # drained before its turn came
        try:
            started = self.launcher.start_instance(spec, self.on_ready)
        except Exception:
            logger.exception("%s: could not be started", spec.instance_id)
            started = False
        if not started and not self.launcher.stopping.is_set():
            self.supervisor.retire(spec.instance_id)
            logger.warning("%s: not started; its pool stays one short", spec.instance_id)

    def close(self) -> None:
        """Drops the instances not yet handed to the launcher (shutdown)."""
        self._starter.shutdown(wait=False, cancel_futures=True)

    def fit(self, instance_id: str, role: str) -> str | None:
        """Why the instance cannot join `role`'s pool (None: it can)."""
        spec = self.supervisor.specs.get(instance_id)
        if spec is None:
            return f"{instance_id} belongs to no pool"
        if role != "colocated" and not moves_kv(spec):
            return f"{instance_id} has no KV transfer (--mode colocated): it cannot be {role}"
        template = self._templates.get(role)  # none: the pool was never planned
        if template is not None and (unlike := _unlike(spec, template)) is not None:
            name, mine, theirs = unlike
            return f"{instance_id}'s {name} is {mine}, the {role} pool's {theirs}"
        mine_r, theirs_r = self.launcher.resources_of(spec.role), self.launcher.resources_of(role)
        if mine_r != theirs_r:
            return f"{instance_id} asks Ray for {mine_r}, the {role} pool for {theirs_r}"
        limit = self.max_size(role)
        if limit is not None and len(self.members(role)) >= limit:
            return f"the {role} pool may hold at most {limit} (--max-pool-size)"
        return None

    def move(self, instance_id: str, role: str) -> None:
        """The instance serves in `role`'s pool now; a restart starts it there."""
        spec = self.supervisor.specs.get(instance_id)
        if spec is not None:
            self.supervisor.add(msgspec.structs.replace(spec, role=role))

    def retire(self, instance_id: str) -> None:
        self.supervisor.retire(instance_id)

    def stop(self, instance_id: str) -> None:
        self.launcher.stop_instance(instance_id)
