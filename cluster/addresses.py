"""Where a deployment's sockets bind, and what address its peers are told.

One machine (the local launcher, or Ray without `--ray-address`): everything binds
127.0.0.1, as it always did. A Ray cluster joined with `--ray-address`: each instance
binds and advertises its own node's reachable address, worked out on that node (the
spec carries `NODE_HOST` until then), and the gateway binds the head's, so instances on
other nodes reach its output socket. `PDSERVE_ADVERTISE_HOST` in a node's environment
overrides Ray's choice there (a node with several networks).
"""

from __future__ import annotations

import os

from pdserve.instance.spec import NODE_HOST

LOOPBACK = "127.0.0.1"
ADVERTISE_HOST_ENV = "PDSERVE_ADVERTISE_HOST"


def across_nodes(launcher: str, ray_address: str | None) -> bool:
    """Whether instances may run on other machines than the gateway's."""
    return launcher == "ray" and ray_address is not None


def instance_host(spread: bool) -> str:
    """What goes into each instance's spec: loopback, or "resolve it on the node"."""
    return NODE_HOST if spread else LOOPBACK


def node_host() -> str:
    """This node's address for peers on other nodes: the override, else Ray's node IP
    (call inside a Ray worker or after `ray.init`)."""
    override = os.environ.get(ADVERTISE_HOST_ENV, "").strip()
    if override:
        return override
    import ray  # Ray lives in cluster/ only; it is loaded by now wherever this runs

    return ray.util.get_node_ip_address()


def resolve_host(host: str) -> str:
    """A spec's host as this process must bind it."""
    return node_host() if host == NODE_HOST else host
