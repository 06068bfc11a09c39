"""Scripted peers that speak the real control protocol and real UCX, but misbehave
on purpose: a prefill rank that answers the handshake and then stays silent, and a
decode rank that asks for blocks and then never reads them."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq

from pdserve.common.frame_seal import KV_CONTROL, Sealer
from pdserve.kvtransfer.messages import (
    ControlMessage,
    Hello,
    HelloReply,
    KVLayout,
    decode_control,
    encode_control,
)


class FakeUcx:
    """A UCX worker that only progresses when the test says so."""

    def __init__(self) -> None:
        import ucxx._lib.libucxx as ucx
        from ucxx._lib.arr import Array

        self._ucx, self._array = ucx, Array
        self.context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG,))
        self.worker = ucx.UCXWorker(self.context)
        self.address = self.worker.address.tobytes()
        self._endpoints: dict[bytes, Any] = {}
        self._requests: list[Any] = []

    def send(self, address: bytes, data: np.ndarray, tag: int) -> Any:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            buffer = self._ucx.UCXAddress.create_from_buffer(address)
            endpoint = self.worker.create_endpoint_from_worker_address(buffer, False)
            self._endpoints[address] = endpoint
        request = endpoint.tag_send(self._array(data), self._ucx.UCXXTag(tag))
        self._requests.append((request, data))
        return request

    def progress_until(self, requests: list[Any], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(r.completed for r in requests):
            if time.monotonic() >= deadline:
                raise TimeoutError("fake UCX sends did not complete")
            self.worker.progress()


class FakePrefill:
    """A ROUTER that answers handshakes like a prefill rank and records every message."""

    def __init__(
        self,
        layout: KVLayout,
        instance_id: str = "fake-p",
        transport: str = "ucx",
        tp_rank: int = 0,
        tp_size: int = 1,
        epoch: int = 0,
    ):
        self.layout, self.instance_id, self.transport = layout, instance_id, transport
        self.epoch = epoch  # its replies carry it
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.hellos: list[Hello] = []
        self.received: list[ControlMessage] = []
        self.sealer = Sealer(KV_CONTROL, "fake-p", responder=True)  # this process's secret

    def serve(self, duration: float) -> None:
        end = time.monotonic() + duration
        while time.monotonic() < end:
            if not self.socket.poll(10):
                continue
            identity, frame = self.socket.recv_multipart()
            message = decode_control(self.sealer.open(frame).payload).message
            self.received.append(message)
            if isinstance(message, Hello):
                self.hellos.append(message)
                reply = HelloReply(
                    self.instance_id, self.tp_rank, self.tp_size, self.layout, self.transport
                )
                frame = self.sealer.seal(encode_control(reply, self.epoch))
                self.socket.send_multipart([identity, frame])

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


class FakeDecode:
    """A DEALER that handshakes and pulls like a decode rank, with a UCX worker that
    never progresses (so the prefill side's sends to it can never complete)."""

    def __init__(self, layout: KVLayout, address: str, ucx: FakeUcx):
        self.layout = layout
        self.ucx = ucx
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, b"fake-d")
        self.socket.connect(address)
        self.sealer = Sealer(KV_CONTROL, "fake-d")  # its routing identity

    def send(self, message: ControlMessage, epoch: int = 0) -> None:
        self.socket.send(self.sealer.seal(encode_control(message, epoch)))

    def handshake(self, timeout: float = 5.0) -> HelloReply:
        self.send(Hello("fake-d", 0, 1, self.layout, "ucx", self.ucx.address))
        reply = self.receive(timeout)
        assert isinstance(reply, HelloReply)
        return reply

    def receive(self, timeout: float) -> ControlMessage:
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError("no message from the prefill side")
        return decode_control(self.sealer.open(self.socket.recv()).payload).message

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
