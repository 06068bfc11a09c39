"""What a decode rank's puller tracks: each request's slices, and each prefill rank
it pulls from with the handshake state of its control connection."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.kvtransfer.control import ControlClient
from pdserve.kvtransfer.layout import KVLayoutMismatch, Run, check_compatible
from pdserve.kvtransfer.messages import Hello, HelloReply, KVLayout, KVSource
from pdserve.kvtransfer.transport import TransferOp


@dataclass
class PullSlice:
    """The heads one prefill rank sends of one request."""

    request: PullRequest
    address: str
    src_rank: int
    head_start: int
    head_end: int
    runs: list[Run]
    transfer_id: int = -1
    ops: list[TransferOp] = field(default_factory=list)
    stagings: list[tuple[Any, int]] = field(default_factory=list)  # (buffer, dst_start)
    state: str = "new"  # new → waiting (handshake) → receiving → received

    @property
    def in_flight(self) -> bool:
        return self.state == "receiving" and not all(op.poll() for op in self.ops)


@dataclass
class PullRequest:
    request_id: str
    source: KVSource
    addresses: list[str]  # the prefill ranks this rank talks to about it
    slices: list[PullSlice] = field(default_factory=list)
    deadline: float | None = None  # set when the pull starts
    started: float | None = None  # perf_counter, for the transfer-time histogram
    started_wall: float | None = None  # time.time(), for the request's timeline
    aborted: bool = False
    failure: str | None = None
    finalized: bool = False

    @property
    def in_flight(self) -> bool:
        return any(s.in_flight for s in self.slices)


@dataclass
class PrefillRank:
    """One prefill rank, by control address."""

    address: str
    rank: int
    tp_size: int
    instance_id: str
    client: ControlClient
    state: str = "idle"  # idle → waiting (Hello sent) → ready
    pp_stage: int = 0  # the pipeline stage both ranks hold
    hello_deadline: float = 0.0
    waiting: list[PullSlice] = field(default_factory=list)
    # The latest epoch of the prefill instance a handoff named: its replies from an
    # older one (a life of it retired since) are dropped.
    epoch: int = 0

    @property
    def name(self) -> str:
        return f"prefill instance {self.instance_id} rank {self.rank}"

    def handshake(self, hello: Hello, deadline: float, epoch: int) -> None:
        """Sends the Hello (in this instance's `epoch`) unless one was sent already (or
        the handshake is done)."""
        if self.state != "idle":
            return
        self.client.send(hello, epoch)
        self.state = "waiting"
        self.hello_deadline = deadline

    def refusal(self, reply: HelloReply, layout: KVLayout) -> str:
        """Why the handshake fails with this reply; empty when it succeeds."""
        if reply.error:
            return reply.error
        try:
            check_compatible(layout, reply.layout, self.name)
        except KVLayoutMismatch as exc:
            return str(exc)
        if reply.pp_stage != self.pp_stage:
            return f"{self.name}: holds pipeline stage {reply.pp_stage}, not {self.pp_stage}"
        if (reply.tp_rank, reply.tp_size) != (self.rank, self.tp_size):
            return (
                f"{self.name}: handshake reports TP rank {reply.tp_rank} of {reply.tp_size}, "
                f"the handoff said rank {self.rank} of {self.tp_size}"
            )
        return ""

    def reset(self, client: ControlClient) -> None:
        """A new connection, to handshake again (the old one is closed)."""
        self.client.close()
        self.client = client
        self.state = "idle"
        self.waiting = []
