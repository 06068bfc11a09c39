"""A worker group's rendezvous: its store and collectives on its interface, keys behind the secret.

The driver serves the group's torch.distributed store (`Rendezvous`) on a socket it
binds itself on the group's interface (loopback when every rank shares its node) at a
port the system picks, handed to the store as a listening descriptor, so the store
never listens on another interface and no port is found free and bound later. The
store has no authentication of its own, so every rank reads and writes it through a
`PrefixStore` whose prefix is derived from the deployment secret and the store's
address (`common/wire_auth.py:rendezvous_prefix`): a peer without the secret cannot
make up a key the group uses (but the store lists its keys to any client, so one that
asks finds them: `docs/security.md`). The driver also sets a key behind that prefix
(`PROOF_KEY`) before any rank starts, which a rank looks for before it joins: a rank
started with another secret finds none behind its own prefix and fails at once,
naming the secret, instead of meeting no peer until the rendezvous times out; a value
a stranger writes over it changes nothing. Each rank points gloo (`GLOO_SOCKET_IFNAME`)
and NCCL's sockets (`NCCL_SOCKET_IFNAME`) at the interface that holds the store's host
before it joins, unless the operator named one. What stays unauthenticated (the
store's keys and port to anyone who reaches the interface, gloo's and NCCL's data
connections) is in `docs/security.md`.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from datetime import timedelta

import torch.distributed as dist

from pdserve.common.wire_auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SecretError,
    deployment_secret,
    ensure_secret,
    rendezvous_prefix,
)

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_BACKLOG = 128
PROOF_KEY = "secret-proof"  # behind the group's prefix: its presence proves the secret


class Rendezvous:
    """The group's store, served by the driver on `host` only."""

    def __init__(self, host: str, timeout_s: float) -> None:
        # The ranks derive the keys' prefix from the secret: one made here (when the
        # environment has none) is inherited by the ranks started after this.
        ensure_secret()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(_BACKLOG)
        port = listener.getsockname()[1]
        try:
            self._store = dist.TCPStore(
                host,
                port,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        # The store now owns the descriptor and closes it when it goes: were Python's
        # socket object to close it too, the second close could hit whatever descriptor
        # took that number in between (another store's, in a test session).
        listener.detach()
        self.address = f"{host}:{port}"
        prefix = rendezvous_prefix(deployment_secret(), self.address)
        dist.PrefixStore(prefix, self._store).set(PROOF_KEY, "1")


def join_store(master: str, timeout_s: float) -> dist.Store:
    """A rank's view of the group's store at `master` (host:port): every key behind the
    prefix only holders of the deployment secret can name."""
    host, port = master.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    group = dist.PrefixStore(rendezvous_prefix(deployment_secret(), master), store)
    check_proof(group, master)
    return group


def check_proof(group: dist.Store, master: str) -> None:
    """SecretError unless the driver's proof is behind this rank's prefix (the driver
    sets it before any rank starts, so it is never waited for)."""
    if not group.check([PROOF_KEY]):
        raise SecretError(
            f"the deployment secret ({SECRET_ENV} or {SECRET_FILE_ENV}) of this rank differs "
            f"from its worker group's driver's (rendezvous {master}): start every rank "
            "with the driver's secret"
        )


def bind_collectives(host: str) -> str:
    """Points gloo and NCCL's sockets at the interface holding `host` (unless the
    operator set them); returns the interface's name."""
    name = interface_of(host)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return name


def interface_of(host: str) -> str:
    """The name of the network interface whose IPv4 address is `host`."""
    address = socket.inet_aton(socket.gethostbyname(host))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if answer[20:24] == address:
                return name
    raise OSError(f"no network interface holds {host}")
