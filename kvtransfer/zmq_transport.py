"""A plain ZMQ TCP copy for machines without UCX; chosen explicitly, never a fallback.

Each side binds a PULL socket; a sender connects a PUSH socket to it. A message goes
as chunks of [tag + offset, payload] frames, sent without copying (a send is done
once ZMQ has let go of every chunk), and each chunk lands in place as it arrives, so
a large message streams instead of being buffered whole. Receives are posted before
the pull request goes out, so a chunk without a posted receive belongs to a
cancelled transfer and is dropped. Each chunk carries a seal of the `kv_data` channel
over its header and bytes (`pdserve.common.frame_seal`), checked before a byte lands
(a replayed chunk is dropped too): a process without the secret cannot write into KV
memory.
"""

from __future__ import annotations

import struct
from typing import Any, cast

import numpy as np
import zmq

from pdserve.common import frame_drops
from pdserve.common.frame_seal import Channel, Sealer
from pdserve.kvtransfer.transport import TransferOp, Transport

_CHUNK = 4 << 20
CHUNK_HEADER = struct.Struct("<QQ")  # tag, byte offset: the part between the seal and the bytes
KV_DATA = Channel("kv_data", _CHUNK + CHUNK_HEADER.size)


class _SendOp(TransferOp):
    def __init__(self, nbytes: int, trackers: list[zmq.MessageTracker], view: np.ndarray):
        super().__init__(nbytes)
        self._trackers = trackers
        self._view = view  # keeps a staging buffer alive while ZMQ reads it

    def poll(self) -> bool:
        if not self.done and all(t.done for t in self._trackers):
            self.done = True
            self._trackers, self._view = [], self._view[:0]
        return self.done


class _RecvOp(TransferOp):
    def __init__(self, view: np.ndarray):
        super().__init__(view.nbytes)
        self.view = view
        self.received = 0

    def poll(self) -> bool:
        return self.done


def _host_view(buffer: Any) -> np.ndarray:
    if not isinstance(buffer, np.ndarray):
        raise TypeError("the zmq KV transport moves host memory only")
    return buffer.reshape(-1)


class ZmqTransport(Transport):
    name = "zmq"

    def __init__(self, context: zmq.Context, host: str, sealer: Sealer | None = None):
        self._context = context
        self._sealer = sealer or Sealer(KV_DATA, f"kv-data {host}")
        self._opener = Sealer(KV_DATA, f"kv-data {host}", responder=True)
        self._inbox = context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, 2 * _CHUNK)  # no frame is larger than a chunk
        port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self._info = f"tcp://{host}:{port}".encode()
        self._peer_info: dict[str, bytes] = {}
        self._outboxes: dict[str, zmq.Socket] = {}
        self._recvs: dict[int, _RecvOp] = {}

    @property
    def info(self) -> bytes:
        return self._info

    def poll_handles(self) -> list[Any]:
        return [self._inbox]

    def add_peer(self, peer: str, info: bytes, host: str = "") -> None:
        self._drop_outbox(peer)
        self._peer_info[peer] = info

    def _outbox(self, peer: str) -> zmq.Socket:
        socket = self._outboxes.get(peer)
        if socket is None:
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.connect(self._peer_info[peer].decode())
            self._outboxes[peer] = socket
        return socket

    def send(self, peer: str, buffer: Any, tag: int) -> TransferOp:
        view = _host_view(buffer)
        socket, trackers = self._outbox(peer), []
        for offset in range(0, max(view.nbytes, 1), _CHUNK):
            chunk = view[offset : offset + _CHUNK]
            header = CHUNK_HEADER.pack(tag, offset)
            data = chunk.data
            frames: list[bytes | memoryview] = [self._sealer.seal_parts(header, data), header, data]
            tracker = socket.send_multipart(frames, copy=False, track=True)
            trackers.append(cast(zmq.MessageTracker, tracker))  # track=True: always one
        return _SendOp(view.nbytes, trackers, view)

    def recv(self, buffer: Any, tag: int) -> TransferOp:
        op = _RecvOp(_host_view(buffer))
        self._recvs[tag] = op
        return op

    def cancel_recvs(self, ops: list[TransferOp]) -> None:
        cancel = {id(op) for op in ops}
        for tag, op in list(self._recvs.items()):
            if id(op) in cancel:
                del self._recvs[tag]
                op.done, op.error = True, "cancelled"

    def _drop_outbox(self, peer: str) -> None:
        socket = self._outboxes.pop(peer, None)
        if socket is not None:
            socket.close(linger=0)

    def progress(self) -> None:
        while self._inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = self._inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            if len(frames) != 3 or len(frames[1].bytes) != CHUNK_HEADER.size:
                self._opener.refuse(frame_drops.MALFORMED, "the KV data socket")
                continue
            head, header, payload = frames
            if (
                self._opener.open_parts(
                    head.bytes, header.bytes, payload.buffer, origin="the KV data socket"
                )
                is None
            ):
                continue
            tag, offset = CHUNK_HEADER.unpack(header.bytes)
            op = self._recvs.get(tag)
            if op is None:
                continue  # a cancelled transfer's data
            data = np.frombuffer(payload.buffer, dtype=np.uint8)
            if offset + data.nbytes > op.nbytes:
                op.error = f"{offset + data.nbytes} bytes sent for a {op.nbytes}-byte buffer"
            else:
                op.view[offset : offset + data.nbytes] = data
                op.received += data.nbytes
            if op.error or op.received == op.nbytes:
                del self._recvs[tag]
                op.done = True

    def ready_to_block(self) -> bool:
        return True

    def close(self) -> None:
        for peer in list(self._outboxes):
            self._drop_outbox(peer)
        self._inbox.close(linger=0)
