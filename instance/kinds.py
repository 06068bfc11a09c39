"""The roles an instance can run, by name: a plain mapping, imported by the step loop.

Each kind builds its role object from the loaded loop. Beside the engine's KV cache
every rank of an instance that moves KV (a prefill or decode one, or a colocated one
whose spec has KV transfer) holds a transfer worker that serves pulls and pulls alike,
so the instance can change role without a new worker (`instance/role_switch.py`);
a colocated one without KV transfer holds nothing there. The roles live in their own
rooms and know nothing of this one: they get the engine, their KV link and the loop's
send functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pdserve.common import messages as wire
from pdserve.decode.kv_puller import DecodeKVPuller
from pdserve.decode.role import DecodeRole
from pdserve.engine.executor import ConnectorFactory
from pdserve.instance.colocated import ColocatedRole
from pdserve.instance.spec import InstanceSpec, moves_kv
from pdserve.kvtransfer import KVTransferConfig, layout_of
from pdserve.kvtransfer.connector import TransferConnectorFactory
from pdserve.kvtransfer.link import KVLink
from pdserve.prefill.kv_server import PrefillKVServer
from pdserve.prefill.role import PrefillRole

if TYPE_CHECKING:
    from pdserve.instance.loop import StepLoop


class Role(Protocol):
    """What the step loop calls on its role, in loop order (see instance/loop.py)."""

    # ValueError: cannot run here. `received_at`: when the I/O thread decoded it
    # (`time.monotonic()`; None: held back since), where its queue starts.
    def admit(self, task: wire.GenerateTask, received_at: float | None = None) -> None: ...

    # A role's own task types (e.g. a decode role's handoffs).
    def on_task(self, task: Any, received_at: float | None = None) -> wire.RequestDelta | None: ...

    def abort(self, task: wire.AbortTask) -> None: ...

    def request_ids(self) -> set[str]: ...  # every request here, deferred ones included

    def task_wait_s(self, idle_wait_s: float) -> float: ...

    def before_step(self) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[wire.RequestDelta]: ...

    def after_step(self, deltas: list[wire.RequestDelta]) -> list[wire.RequestDelta]: ...

    def has_news(self) -> bool: ...  # send an output even without deltas

    def add_metrics(self, metrics: wire.MetricsDelta) -> None: ...

    def add_stats(self, stats: wire.InstanceStats) -> None: ...


@dataclass(frozen=True)
class RoleKind:
    task_type: Any  # the union the task socket decodes
    # Builds each rank's KV connector (None: the role moves no KV).
    connector: Callable[[InstanceSpec], ConnectorFactory | None]
    build: Callable[[StepLoop], Role]


def kv_transfer_config(spec: InstanceSpec) -> KVTransferConfig:
    """The spec's KV transfer config under the spec's own id, host and epoch (a pool's
    copy of a spec gets a new id; an instance on a cluster node learns its host there;
    a replacement starts in a later epoch)."""
    if spec.kv_transfer is None:  # the defaults
        return KVTransferConfig(instance_id=spec.instance_id, host=spec.host, epoch=spec.epoch)
    return msgspec.structs.replace(
        spec.kv_transfer, instance_id=spec.instance_id, host=spec.host, epoch=spec.epoch
    )


def kv_link(loop: StepLoop) -> KVLink:
    """The instance's one link to its ranks' KV connectors: a role switch hands it to
    the next role, so the ranks' counters (sums since they started) stay one baseline."""
    if loop.link is None:
        engine = loop.require_engine()
        loop.link = KVLink(
            kv_transfer_config(loop.spec),
            layout_of(
                engine.info.kv,
                len(engine.info.connector_addresses) // engine.info.kv.pipeline_parallel_size,
            ),
            list(engine.info.connector_addresses),
            engine.exchange_kv,
        )
    return loop.link


def _prefill(loop: StepLoop) -> Role:
    engine = loop.require_engine()
    return PrefillRole(
        loop.spec.instance_id,
        engine,
        kv_link(loop),
        loop.send_to_instance,
        loop.flush,
        epoch=loop.spec.epoch,
    )


def _decode(loop: StepLoop) -> Role:
    delayed = loop.hooks.delayed_pulls() if loop.hooks is not None else None
    engine, spec = loop.require_engine(), loop.spec
    return DecodeRole(spec.instance_id, engine, kv_link(loop), delayed, epoch=spec.epoch)


def transfer_connector(spec: InstanceSpec) -> ConnectorFactory | None:
    """Each rank's KV connector: both sides, whichever role the instance has now."""
    if not moves_kv(spec):
        return None
    return TransferConnectorFactory(
        kv_transfer_config(spec), serve=PrefillKVServer, pull=DecodeKVPuller
    )


ROLES: dict[str, RoleKind] = {
    "colocated": RoleKind(
        wire.Task,
        transfer_connector,
        lambda loop: ColocatedRole(loop.spec.instance_id, loop.require_engine()),
    ),
    "prefill": RoleKind(wire.Task, transfer_connector, _prefill),
    "decode": RoleKind(DecodeRole.task_type, transfer_connector, _decode),
}


def role_kind(role: str) -> RoleKind:
    kind = ROLES.get(role)
    if kind is None:
        raise ValueError(f"unknown instance role {role!r}; known: {', '.join(ROLES)}")
    return kind
