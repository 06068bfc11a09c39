"""A plain ZMQ TCP copy for machines without UCX; chosen explicitly, never a fallback.

Each side binds a PULL socket; a sender connects a PUSH socket to it and sends
[tag, payload] frames. The payload is copied into ZMQ at send time, so a send is
done at once and its source blocks are free to reuse. Receives are posted before
the pull request goes out, so a frame without a posted receive belongs to a
cancelled transfer and is dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zmq

from kvtransfer.transport import TransferOp, Transport


class _ZmqOp(TransferOp):
    def poll(self) -> bool:
        return self.done


def _host_view(buffer: Any) -> np.ndarray:
    if not isinstance(buffer, np.ndarray):
        raise TypeError("the zmq KV transport moves host memory only")
    return buffer.reshape(-1)


class ZmqTransport(Transport):
    name = "zmq"

    def __init__(self, context: zmq.Context, host: str):
        self._context = context
        self._inbox = context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self._info = f"tcp://{host}:{port}".encode()
        self._peer_info: dict[str, bytes] = {}
        self._outboxes: dict[str, zmq.Socket] = {}
        self._recvs: dict[int, tuple[_ZmqOp, np.ndarray]] = {}

    @property
    def info(self) -> bytes:
        return self._info

    def poll_handles(self) -> list[Any]:
        return [self._inbox]

    def add_peer(self, peer: str, info: bytes) -> None:
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
        self._outbox(peer).send_multipart([tag.to_bytes(8, "little"), view], copy=True)
        op = _ZmqOp(view.nbytes)
        op.done = True
        return op

    def recv(self, buffer: Any, tag: int) -> TransferOp:
        view = _host_view(buffer)
        op = _ZmqOp(view.nbytes)
        self._recvs[tag] = (op, view)
        return op

    def cancel_recvs(self, ops: list[TransferOp]) -> None:
        cancel = {id(op) for op in ops}
        for tag, (op, _) in list(self._recvs.items()):
            if id(op) in cancel:
                del self._recvs[tag]
                op.done, op.error = True, "cancelled"

    def _drop_outbox(self, peer: str) -> None:
        socket = self._outboxes.pop(peer, None)
        if socket is not None:
            socket.close(linger=0)

    def progress(self) -> None:
        while self._inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            tag_bytes, payload = self._inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            entry = self._recvs.pop(int.from_bytes(tag_bytes.bytes, "little"), None)
            if entry is None:
                continue  # a cancelled transfer's data
            op, view = entry
            data = np.frombuffer(payload.buffer, dtype=np.uint8)
            if data.nbytes != view.nbytes:
                op.error = f"message of {data.nbytes} bytes for a {view.nbytes}-byte buffer"
            else:
                np.copyto(view, data)
            op.done = True

    def ready_to_block(self) -> bool:
        return True

    def close(self) -> None:
        for peer in list(self._outboxes):
            self._drop_outbox(peer)
        self._inbox.close(linger=0)
