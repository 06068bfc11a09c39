"""The data-plane interface both transports implement, and how to pick one.

Tagged two-sided messages: the decode side posts receives into its KV memory under
tags it chose, then asks the prefill side to send under the same tags. Only the
sending side addresses a peer; receives match on the tag alone.

An op is `done` once the transport can no longer touch its buffer, whether it
succeeded, failed or was cancelled; only then may its blocks be reused. Receives can
be cancelled; sends cannot (see prefill/kv_server.py for how a stuck send is handled).
"""

from __future__ import annotations

import abc
from typing import Any

TRANSPORTS = ("ucx", "ucx-listener", "zmq")


class TransferOp(abc.ABC):
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.done = False
        self.error: str | None = None

    @abc.abstractmethod
    def poll(self) -> bool:
        """Update and return `done`."""


class Transport(abc.ABC):
    name: str
    # Whether buffers may be CUDA memory; a host-only transport gets CUDA KV through
    # host staging buffers (`KVMemory`'s `host=True` paths).
    moves_device_memory: bool = False

    @property
    @abc.abstractmethod
    def info(self) -> bytes:
        """What a sender needs to reach this side (goes into the handshake)."""

    @abc.abstractmethod
    def poll_handles(self) -> list[Any]:
        """File descriptors or ZMQ sockets whose readiness means progress is due."""

    @abc.abstractmethod
    def add_peer(self, peer: str, info: bytes, host: str = "") -> None:
        """Remember how to send to `peer` (the receiver's `info`; `host`, the node
        address it binds, empty when unknown)."""

    @abc.abstractmethod
    def send(self, peer: str, buffer: Any, tag: int) -> TransferOp: ...

    @abc.abstractmethod
    def recv(self, buffer: Any, tag: int) -> TransferOp: ...

    @abc.abstractmethod
    def cancel_recvs(self, ops: list[TransferOp]) -> None:
        """Cancel these receives; each becomes done (with an error) once the
        transport has let go of its buffer."""

    @abc.abstractmethod
    def progress(self) -> None: ...

    @abc.abstractmethod
    def ready_to_block(self) -> bool:
        """True when nothing is pending and waiting on poll_handles() is safe."""

    @abc.abstractmethod
    def close(self) -> None: ...


def make_transport(name: str, host: str, tls: str | None, zmq_context: Any) -> Transport:
    """The transport named in the config; never a silent substitute."""
    if name in ("ucx", "ucx-listener"):
        from pdserve.kvtransfer.ucx_transport import UcxTransport

        return UcxTransport(listener=name == "ucx-listener", host=host, tls=tls)
    if name == "zmq":
        from pdserve.kvtransfer.zmq_transport import ZmqTransport

        return ZmqTransport(zmq_context, host)
    raise ValueError(f"unknown KV transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
