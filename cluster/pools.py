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
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import msgspec

from pdserve.cluster.launcher import Launcher, ReadyCallback
from pdserve.cluster.supervisor import Supervisor
from pdserve.instance.spec import InstanceSpec

logger = logging.getLogger(__name__)

START_WORKERS = 2


def index_of(instance_id: str) -> int:
    """`decode-3` → 3 (ids are "<role>-<n>")."""
    suffix = instance_id.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else 0


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

    def retire(self, instance_id: str) -> None:
        self.supervisor.retire(instance_id)

    def stop(self, instance_id: str) -> None:
        self.launcher.stop_instance(instance_id)
