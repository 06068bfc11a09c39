"""Changes an instance's role in place: waits until the old role holds nothing, then
builds the new one over the same engine (weights, KV cache and prefix cache kept).

The gateway stops routing to the instance before it sends `SwitchRoleTask`, so only
what the old role already holds has to end: requests running or waiting, a prefill
role's handed-off blocks (until pulled, released or their lease ran out), blocks a
cancelled transfer may still touch, deferred tasks. The ranks' KV connectors serve and
pull alike (`instance/kinds.py`), so they stay as they are; a colocated instance of a
deployment without KV transfer has none and can switch to no role that moves KV.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec

from pdserve.common import messages as wire
from pdserve.instance.kinds import role_kind
from pdserve.instance.spec import moves_kv

if TYPE_CHECKING:
    from pdserve.instance.loop import StepLoop

logger = logging.getLogger(__name__)


class RoleSwitch:
    """One instance's pending switch, if any; the step loop asks it every turn."""

    def __init__(self, loop: StepLoop) -> None:
        self.loop = loop
        self.pending: wire.SwitchRoleTask | None = None
        self._asked_at = 0.0

    def request(self, task: wire.SwitchRoleTask) -> None:
        """Takes the switch; ValueError when this instance cannot take the role."""
        role_kind(task.role)  # an unknown role fails here
        if task.role != "colocated" and not moves_kv(self.loop.spec):
            raise ValueError(
                f"{self.loop.spec.instance_id} has no KV transfer (--mode colocated): "
                f"it cannot become {task.role}"
            )
        self.pending = task
        self._asked_at = time.monotonic()

    def ready(self) -> bool:
        """Whether a switch waits and the old role has let go of everything."""
        if self.pending is None:
            return False
        role, scheduler = self.loop.require_role(), self.loop.require_engine().scheduler
        return not (
            role.request_ids() or role.has_work() or scheduler.held or scheduler.quarantined
        )

    def apply(self) -> wire.InstanceInfo:
        """Builds the new role over the loaded engine; returns the instance as it serves
        now (its new role and epoch), for the output that announces it."""
        task = self.pending
        assert task is not None, "apply() follows ready()"
        loop = self.loop
        old, epoch = loop.spec.role, task.epoch + 1  # the epoch after the one it was sent to
        loop.spec = msgspec.structs.replace(loop.spec, role=task.role, epoch=epoch)
        loop.kind = role_kind(task.role)
        loop.role = loop.kind.build(loop)
        # Epoch first: a heartbeat between the two is dropped as of an epoch to come,
        # never counted as the old epoch's under the new role. Tasks for the old epoch
        # are still taken until the gateway names the new one (`instance/task_epochs.py`).
        loop.io.epochs.switch(epoch)
        loop.io.change_role(task.role, loop.kind.task_type)
        self.pending = None
        if loop.on_role is not None:
            loop.on_role(task.role)
        logger.warning(
            "%s: %s → %s after %.3f s (epoch %d)",
            loop.spec.instance_id,
            old,
            task.role,
            time.monotonic() - self._asked_at,
            epoch,
        )
        return loop.info()
