"""A worker group's rendezvous: its store and collectives on its interface, keys behind the secret.

The driver serves the group's torch.distributed store (`Rendezvous`) on a socket it
binds itself on the group's interface (loopback when every rank shares its node) at a
port the system picks, handed to the store as a listening descriptor, so the store
never listens on another interface and no port is found free and bound later. The
store has no authentication of its own, so every rank reads and writes it through a
`PrefixStore` whose prefix is derived from the deployment secret and the store's
address (`common/wire_auth.py:rendezvous_prefix`): a peer without the secret cannot
make up a key the group uses. The store lists its keys to any client, though, so every
value also carries an HMAC over its key and itself (`SealedStore`): a stranger who
lists and reads the keys (gloo's and NCCL's addresses) cannot put a value of its own
where a rank reads one; one that fails its seal ends the rank's join, naming it. The
driver also sets a key behind that prefix (`PROOF_KEY`) before any rank starts, which a
rank looks for before it joins: a rank started with another secret finds none behind
its own prefix and fails at once, naming the secret, instead of meeting no peer until
the rendezvous times out; a value a stranger writes over it changes nothing. Each rank
points gloo (`GLOO_SOCKET_IFNAME`) and NCCL's sockets (`NCCL_SOCKET_IFNAME`) at the
interface that holds the store's host before it joins, unless the operator named one.
What stays unauthenticated (the store's port and key names to anyone who reaches the
interface, who can also delete or spoil keys; gloo's and NCCL's data
connections) is in `docs/security.md`.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
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
    rendezvous_value_key,
)

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_BACKLOG = 128
_TAG_BYTES = 32  # HMAC-SHA256, in front of every value
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
        group_store(self._store, deployment_secret(), self.address).set(PROOF_KEY, "1")


def join_store(master: str, timeout_s: float) -> dist.Store:
    """A rank's view of the group's store at `master` (host:port): every key behind the
    prefix only holders of the deployment secret can name."""
    host, port = master.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    group = group_store(store, deployment_secret(), master)
    check_proof(group, master)
    return group


def group_store(store: dist.Store, secret: bytes, master: str) -> SealedStore:
    """The group's keys in `store` (at `master`): behind the prefix, every value sealed."""
    return SealedStore(dist.PrefixStore(rendezvous_prefix(secret, master), store), secret, master)


class StoreValueForged(RuntimeError):
    """A value in the group's store that its seal does not match."""


class SealedStore(dist.Store):
    """A store whose values each carry HMAC-SHA256 (`wire_auth.rendezvous_value_key`)
    over their key and themselves. Only `set` and `get` carry values a rank trusts
    (gloo and NCCL exchange their addresses through them); a counter (`add`) and
    presence (`check`, `wait`) pass through. Another call (`compare_set`, ...) is not
    served, so nothing reaches the store unsealed."""

    def __init__(self, inner: dist.Store, secret: bytes, master: str) -> None:
        super().__init__()
        self._inner = inner
        self._key = rendezvous_value_key(secret)
        self._master = master

    def _tag(self, key: str, value: bytes) -> bytes:
        name = key.encode()
        message = len(name).to_bytes(4, "little") + name + value
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._tag(key, data) + data)  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        raw = self._inner.get(key)
        tag, value = raw[:_TAG_BYTES], raw[_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(key, value)):
            raise StoreValueForged(
                f"the value of {key!r} in the worker group's store (rendezvous "
                f"{self._master}) fails its seal: a process without the deployment secret "
                "wrote it; keep the group's ports to the cluster's nodes"
            )
        return value

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)


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
