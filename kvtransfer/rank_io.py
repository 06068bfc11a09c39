"""What the prefill and the decode side of a TP rank's KV-transfer I/O thread share:
the rank's place in its instance, its KV memory and transport, and the stats both count
into; and what the worker asks of each side (`Serving`, `Pulling`), which the roles hand
in (`prefill/kv_server.py`, `decode/kv_puller.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.control import ControlServer
from pdserve.kvtransfer.kv_memory import KVMemory
from pdserve.kvtransfer.layout import head_range
from pdserve.kvtransfer.messages import (
    ControlEnvelope,
    HoldSpec,
    KeepaliveSpec,
    KVLayout,
    PullSpec,
)
from pdserve.kvtransfer.metrics import KVTransferStats
from pdserve.kvtransfer.transport import Transport


@dataclass
class RankIO:
    config: KVTransferConfig
    layout: KVLayout
    tp_rank: int
    tp_size: int
    memory: KVMemory
    transport: Transport
    stats: KVTransferStats
    pp_stage: int = 0  # a rank of stage s serves and pulls stage s's layers only
    # The instance's epoch as the latest command batch named it (the I/O thread's):
    # every control message this rank sends carries it.
    epoch: int = 0

    @property
    def heads(self) -> tuple[int, int]:
        """The global kv heads this rank holds, [start, end)."""
        return head_range(self.layout, self.tp_rank, self.tp_size)

    def introduction(self) -> tuple[str, int, int, KVLayout, str]:
        """Who this rank is, as a handshake (`Hello`, `HelloReply`) starts."""
        return (
            self.config.instance_id,
            self.tp_rank,
            self.tp_size,
            self.layout,
            self.transport.name,
        )


class Serving(Protocol):
    """The prefill side of the I/O thread (`prefill/kv_server.py:PrefillKVServer`)."""

    def hold(self, spec: HoldSpec, now: float) -> None: ...

    def abort(self, request_id: str, now: float) -> None: ...

    def on_message(self, peer: bytes, envelope: ControlEnvelope, now: float) -> None: ...

    def poll(self, now: float) -> None: ...

    def next_deadline(self) -> float | None: ...


class Pulling(Protocol):
    """The decode side of the I/O thread (`decode/kv_puller.py:DecodeKVPuller`)."""

    def keepalive(self, spec: KeepaliveSpec, now: float) -> None: ...

    def pull(self, spec: PullSpec, now: float) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def receive(self, now: float) -> None: ...

    def poll(self, now: float) -> None: ...

    def quarantined(self) -> list[str]: ...

    def sockets(self) -> list[zmq.Socket]: ...

    def next_deadline(self) -> float | None: ...

    def close(self) -> None: ...


# Built on the I/O thread from the rank's parts and the worker's report callback.
ServingFactory = Callable[[RankIO, ControlServer, Callable[..., None]], Serving]
PullingFactory = Callable[[RankIO, zmq.Context, Callable[..., None]], Pulling]


class NoServing:
    """A rank that serves no pulls (a decode instance's): holds and messages are dropped."""

    def hold(self, spec: HoldSpec, now: float) -> None:
        pass

    def abort(self, request_id: str, now: float) -> None:
        pass

    def on_message(self, peer: bytes, envelope: Any, now: float) -> None:
        pass

    def poll(self, now: float) -> None:
        pass

    def next_deadline(self) -> float | None:
        return None


class NoPulling:
    """A rank that pulls nothing (a prefill instance's): keepalives and pulls are dropped."""

    def keepalive(self, spec: KeepaliveSpec, now: float) -> None:
        pass

    def pull(self, spec: PullSpec, now: float) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass

    def receive(self, now: float) -> None:
        pass

    def poll(self, now: float) -> None:
        pass

    def quarantined(self) -> list[str]:
        return []

    def sockets(self) -> list[zmq.Socket]:
        return []

    def next_deadline(self) -> float | None:
        return None

    def close(self) -> None:
        pass
