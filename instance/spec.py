"""What one instance needs to start: a torch-free message (its engine and KV transfer
configs are torch-free Structs too), so launchers and the gateway process can build it
without loading the engine."""

from __future__ import annotations

import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.kvtransfer.config import KVTransferConfig

# A spec's host for an instance on a cluster node: the launcher replaces it, on the
# node, with that node's reachable address (cluster/addresses.py).
NODE_HOST = "node"


class InstanceSpec(msgspec.Struct, kw_only=True):
    """Everything one instance process needs to start (JSON on a command line, or an
    actor's constructor argument)."""

    instance_id: str
    role: str = "colocated"
    gateway_address: str  # the gateway's PULL endpoint for outputs
    host: str = "127.0.0.1"  # binds and advertises every socket here (or NODE_HOST)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    heartbeat_interval_s: float = 0.5
    idle_wait_s: float = 0.5  # longest wait for a task while there is nothing to step
    test_hooks: bool = False  # honour LeakBlocksTask (tests only)
    # The prefill and decode kinds' KV transfer (None: its defaults; colocated moves no
    # KV). Its instance id, host and epoch are this spec's
    # (`instance/kinds.py:kv_transfer_config`).
    kv_transfer: KVTransferConfig | None = None
    cpus: list[int] = []  # cores to pin to (empty: no pinning)
    # CUDA_VISIBLE_DEVICES of a local process, one GPU per rank (empty: leave it as is).
    gpus: list[str] = []
    # The epoch its outputs start in: a restarted instance goes on from the one the
    # gateway retired with its predecessor, so nothing of the old life passes for new.
    epoch: int = 0


def moves_kv(spec: InstanceSpec) -> bool:
    """Whether the instance's ranks hold a KV transfer worker (what every role but
    colocated needs, so only such an instance may switch to one)."""
    return spec.role != "colocated" or spec.kv_transfer is not None
