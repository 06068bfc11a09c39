"""A Ray cluster joined with `--ray-address`: what it has, before anything is planned.

The gateway machine is only one node of it, so the GPU inventory and the cores the
instances share come from the cluster's resources (`ray.cluster_resources()`), not
from `nvidia-smi` or the cores here. Ray is initialised once, here, in the namespace
the launcher uses afterwards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.cluster.addresses import ADVERTISE_HOST_ENV
from pdserve.cluster.launcher import LaunchError


@dataclass(frozen=True)
class ClusterInventory:
    cores: list[int]  # one per CPU of the whole cluster (counted, never pinned)
    gpus: list[str]  # one id per GPU of the whole cluster (Ray picks the real device)


def ray_module():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's C++ crash handler would catch SIGTERM too and dump a stack trace on every
    # clean Ctrl-C / SIGTERM shutdown of this process.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    import ray

    return ray


def join(address: str | None, namespace: str) -> bool:
    """Connects this process to Ray (starting a local cluster when `address` is None);
    True when it started one."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    options = {}
    override = os.environ.get(ADVERTISE_HOST_ENV, "").strip()
    if address is not None and override:
        # A multi-homed driver: the raylet it must find is the one on this address.
        options["_node_ip_address"] = override
    try:
        ray.init(
            address=address,
            namespace=namespace,
            logging_level="WARNING",
            log_to_driver=True,
            configure_logging=True,
            **options,
        )
    except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError...
        where = address or "a new local cluster"
        raise LaunchError(f"cannot start or join Ray ({where}): {one_line(exc)}") from None
    return address is None


def inventory() -> ClusterInventory:
    """The joined cluster's CPUs and GPUs (call after `join`)."""
    resources = ray_module().cluster_resources()
    cpus = int(resources.get("CPU", 0))
    gpus = int(resources.get("GPU", 0))
    if cpus < 1:
        raise LaunchError("the Ray cluster reports no CPU; are its nodes up?")
    return ClusterInventory(list(range(cpus)), [str(i) for i in range(gpus)])


def one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # Ray wraps the actor's error; its last line is the actual exception.
    text = lines[-1] if lines else type(exc).__name__
    return text[:300]
