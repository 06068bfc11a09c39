"""A prefill KV server over a transport whose sends complete when the test says so."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pdserve.kvtransfer import KVLayout, KVTransferConfig, KVTransferStats
from pdserve.kvtransfer.kv_memory import KVMemory
from pdserve.kvtransfer.messages import ControlEnvelope, Hello
from pdserve.kvtransfer.rank_io import RankIO
from pdserve.kvtransfer.transport import TransferOp, Transport
from pdserve.prefill.kv_server import PrefillKVServer

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
PEER = b"decode-rank"
OTHER = b"another-decode-rank"


class HeldOp(TransferOp):
    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.complete = False

    def poll(self) -> bool:
        self.done = self.complete
        return self.done


class ManualTransport(Transport):
    name = "ucx"

    def __init__(self) -> None:
        self.sent: list[HeldOp] = []

    @property
    def info(self) -> bytes:
        return b"manual"

    def poll_handles(self) -> list[Any]:
        return []

    def add_peer(self, peer: str, info: bytes, host: str = "") -> None:
        pass

    def send(self, peer: str, buffer: Any, tag: int) -> TransferOp:
        op = HeldOp(buffer.nbytes)
        self.sent.append(op)
        return op

    def recv(self, buffer: Any, tag: int) -> TransferOp:
        raise NotImplementedError

    def cancel_recvs(self, ops: list[TransferOp]) -> None:
        raise NotImplementedError

    def progress(self) -> None:
        pass

    def ready_to_block(self) -> bool:
        return True

    def close(self) -> None:
        pass


def sent(message: Any, epoch: int = 0) -> ControlEnvelope:
    """A control message as its sender's rank sent it, in `epoch`."""
    return ControlEnvelope(epoch, message)


def hello(
    instance_id: str = "d", info: bytes = b"addr", epoch: int = 0, tp_size: int = 1
) -> ControlEnvelope:
    """Rank 0 of decode instance `instance_id` introduces itself over the manual transport."""
    return sent(Hello(instance_id, 0, tp_size, LAYOUT, ManualTransport.name, info), epoch)


class RecordingServer:
    def __init__(self) -> None:
        self.messages: list[tuple[bytes, Any]] = []

    def send(self, identity: bytes, message: Any, epoch: int) -> None:
        self.messages.append((identity, message))


class Served(NamedTuple):
    """A prefill rank's server and what it sent, replied, counted and reported."""

    side: PrefillKVServer
    transport: ManualTransport
    server: RecordingServer
    stats: KVTransferStats
    reports: list[tuple[str, str]]


def serve(epoch: int = 0, **settings: Any) -> Served:
    """Prefill instance "p", rank 0 of 1, eight zeroed blocks; `settings` go to its config."""
    storage = np.zeros((8, 2, 2, 2, 4, 8), dtype=np.float32)
    transport, server, stats = ManualTransport(), RecordingServer(), KVTransferStats()
    reports: list[tuple[str, str]] = []
    config = KVTransferConfig(instance_id="p", **settings)
    memory = KVMemory(storage, LAYOUT)
    rank = RankIO(config, LAYOUT, 0, 1, memory, transport, stats, epoch=epoch)
    side = PrefillKVServer(rank, server, lambda kind, rid: reports.append((kind, rid)))
    return Served(side, transport, server, stats, reports)
