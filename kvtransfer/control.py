"""The control plane between two I/O threads: ZMQ ROUTER (serving) and DEALER (pulling).

The prefill side binds a ROUTER and only ever answers the decode side's DEALER, so a
prefill instance needs no address of its decode peers. Messages are single frames of
msgpack (messages.py) sealed on the `kv_control` channel (`pdserve.common.frame_seal`):
a frame that fails its seal is dropped and counted before it is decoded, so a process
without the secret can neither pull KV nor renew or abort a lease; the server opens a
client's frames only under the client's routing identity, so a captured pull replays
under no other connection. A malformed message is counted and dropped, never fatal.
Every message travels with its sender's epoch (`ControlEnvelope`); a side that drops
one from a life of its sender it no longer deals with counts it here (`drop_stale`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid

import msgspec
import zmq

from pdserve.common import frame_drops
from pdserve.common.frame_drops import DROPS
from pdserve.common.frame_seal import KV_CONTROL, Sealer
from pdserve.kvtransfer.messages import (
    ControlEnvelope,
    ControlMessage,
    decode_control,
    encode_control,
)

logger = logging.getLogger(__name__)


_STALE_LOG_INTERVAL_S = 5.0  # a retired life that keeps talking logs now and then


class _StaleLog:
    """When a stale message was last logged (one book per process, like the counts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged_at = -math.inf

    def due(self) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._logged_at < _STALE_LOG_INTERVAL_S:
                return False
            self._logged_at = now
            return True


_STALE_LOG = _StaleLog()


def drop_stale(message: ControlMessage, sender: str, epoch: int, wanted: str) -> None:
    """Counts (`stale_epoch` on the KV control channel) and, every few seconds, logs a
    message from a life of its sender the receiver no longer deals with; `wanted`: the
    one it does."""
    DROPS.count(KV_CONTROL.name, frame_drops.STALE_EPOCH)
    if _STALE_LOG.due():
        logger.warning(
            "dropping a %s from %s in epoch %d (%s)", type(message).__name__, sender, epoch, wanted
        )


def _decode(
    sealer: Sealer, frame: bytes, origin: str, sender: str | None = None
) -> ControlEnvelope | None:
    opened = sealer.open(frame, origin, sender=sender)
    if opened is None:
        return None
    try:
        return decode_control(opened.payload)
    except msgspec.DecodeError as exc:
        sealer.refuse(frame_drops.UNDECODABLE, origin)
        logger.warning("dropping a malformed control message from %s: %s", origin, exc)
        return None


class ControlServer:
    """ROUTER socket: decode peers connect here."""

    def __init__(
        self, context: zmq.Context, host: str, port: int = 0, sealer: Sealer | None = None
    ):
        self._sealer = sealer or Sealer(KV_CONTROL, f"kv-server {host}", responder=True)
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, KV_CONTROL.max_message_bytes)
        try:
            if port:
                self.socket.bind(f"tcp://{host}:{port}")
            else:
                port = self.socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self.socket.close()
            raise OSError(f"cannot bind the KV control socket on {host}:{port}: {exc}") from exc
        self.address = f"tcp://{host}:{port}"

    def send(self, identity: bytes, message: ControlMessage, epoch: int) -> None:
        """`epoch`: this instance's, as its rank last heard it."""
        try:
            frame = self._sealer.seal(encode_control(message, epoch))
            self.socket.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("control reply to %r dropped: peer not reading", identity)

    def receive(self) -> list[tuple[bytes, ControlEnvelope]]:
        messages = []
        while self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 2:
                self._sealer.refuse(frame_drops.MALFORMED, "a KV peer")
                continue
            identity = frames[0].decode(errors="replace")
            message = _decode(self._sealer, frames[1], f"KV peer {identity!r}", identity)
            if message is not None:
                messages.append((frames[0], message))
        return messages

    def close(self) -> None:
        self.socket.close(linger=0)


class ControlClient:
    """DEALER socket to one prefill rank's ControlServer."""

    def __init__(self, context: zmq.Context, address: str, name: str, sealer: Sealer | None = None):
        # A fresh identity per connection: a restarted peer never sees stale state. The
        # frames are sealed under it: the server opens them only from this connection.
        identity = f"{name}/{uuid.uuid4().hex[:12]}"
        self._sealer = sealer or Sealer(KV_CONTROL, identity)
        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, KV_CONTROL.max_message_bytes)
        self.socket.setsockopt(zmq.IDENTITY, identity.encode())
        self.socket.connect(address)

    def send(self, message: ControlMessage, epoch: int) -> bool:
        """`epoch`: this instance's, as its rank last heard it."""
        try:
            self.socket.send(self._sealer.seal(encode_control(message, epoch)), zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("control message to %s dropped: queue full", self.address)
            return False

    def receive(self) -> list[ControlEnvelope]:
        messages = []
        while self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            message = _decode(self._sealer, self.socket.recv(zmq.NOBLOCK), self.address)
            if message is not None:
                messages.append(message)
        return messages

    def close(self) -> None:
        self.socket.close(linger=0)
