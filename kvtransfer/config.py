"""Settings of one instance's KV transfer; every limit is a number of seconds.

A msgspec Struct: it crosses the process seam inside an `InstanceSpec`, checked where it
is made and again where it is decoded.
"""

from __future__ import annotations

import msgspec

from pdserve.kvtransfer.transport import TRANSPORTS

FAILURE_POLICIES = ("recompute", "fail")


class KVTransferConfig(msgspec.Struct, frozen=True):
    instance_id: str
    # "ucx": worker-address endpoints, error handling off (shared memory on one node);
    # "ucx-listener": listener endpoints, error handling on (TCP/RDMA across nodes);
    # "zmq": plain ZMQ copy. Both sides must use the same one.
    transport: str = "ucx"
    # UCX transports allowed, e.g. "sm,self" or "tcp,self"; None: UCX_TLS or UCX's choice.
    ucx_tls: str | None = None
    host: str = "127.0.0.1"  # where the control socket (and listener) binds
    control_port: int = 0  # 0: any free port
    # P holds handed-off blocks this long without news from D, then frees them.
    lease_s: float = 30.0
    heartbeat_interval_s: float = 2.0
    # D gives up on a pull (handshake included) after this; must stay below lease_s so
    # D has stopped touching P's blocks before P may reuse them.
    transfer_timeout_s: float = 10.0
    handshake_timeout_s: float = 5.0
    # A pull may overtake the hold that announces its request; P waits this long.
    pull_grace_s: float = 2.0
    failure_policy: str = "recompute"
    # The instance's epoch as its ranks start (a replacement's is past its predecessor's):
    # their control messages carry it until commands name another (a role switch).
    epoch: int = 0

    def __post_init__(self) -> None:
        checks = [
            (bool(self.instance_id), "instance_id must not be empty"),
            (
                self.transport in TRANSPORTS,
                f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}",
            ),
            (
                self.failure_policy in FAILURE_POLICIES,
                f"failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}",
            ),
            (self.lease_s > 0, f"lease_s must be positive, got {self.lease_s}"),
            (
                0 < self.heartbeat_interval_s <= self.lease_s / 2,
                f"heartbeat_interval_s must be in (0, lease_s/2], got {self.heartbeat_interval_s}",
            ),
            (
                0 < self.transfer_timeout_s < self.lease_s,
                f"transfer_timeout_s must be in (0, lease_s), got {self.transfer_timeout_s}",
            ),
            (
                0 < self.handshake_timeout_s <= self.transfer_timeout_s,
                "handshake_timeout_s must be in (0, transfer_timeout_s], "
                f"got {self.handshake_timeout_s}",
            ),
            (self.pull_grace_s >= 0, f"pull_grace_s must be >= 0, got {self.pull_grace_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
