"""The cluster's side of `/admin/*` (`gateway/admin.py`'s `PoolControl`): which
instances a pool has, one more started, one drained stopped for good.

A pool's members are the supervisor's: planned or added, loaded or loading, not
retired. One more instance is a copy of the pool's first planned spec under the next
unused id (`decode-2`, ...; an id is never reused, so no retired epoch can be mistaken
for a new life): on the same cores and GPU with the local launcher (scaling up on a GPU
needs room planned for it), with the same resource request under Ray (the actor waits
until a node has room).
"""

from __future__ import annotations

import msgspec

from pdserve.cluster.launcher import Launcher, ReadyCallback
from pdserve.cluster.supervisor import Supervisor
from pdserve.instance.spec import InstanceSpec


def index_of(instance_id: str) -> int:
    """`decode-3` → 3 (ids are "<role>-<n>")."""
    suffix = instance_id.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else 0


class Pools:
    def __init__(self, launcher: Launcher, supervisor: Supervisor, on_ready: ReadyCallback) -> None:
        self.launcher = launcher
        self.supervisor = supervisor
        self.on_ready = on_ready
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

    def start(self, role: str, count: int) -> list[str]:
        template = self._templates.get(role)
        if template is None:
            raise ValueError(f"this deployment has no {role} pool")
        started = []
        for _ in range(count):
            instance_id = f"{role}-{self._next[role]}"
            spec = msgspec.structs.replace(template, instance_id=instance_id, epoch=0)
            if not self.launcher.start_instance(spec, self.on_ready):
                raise ValueError("this launcher cannot start instances")
            self._next[role] += 1
            self.supervisor.add(spec)
            started.append(instance_id)
        return started

    def retire(self, instance_id: str) -> None:
        self.supervisor.retire(instance_id)

    def stop(self, instance_id: str) -> None:
        self.launcher.stop_instance(instance_id)
