"""The prefill side of a rank's KV transfer I/O thread: held requests, leases, pulls
served.

A held request keeps its blocks until every head this rank holds has been confirmed
by a decode rank (`Done`), or the decode side aborts it, or its lease runs out. In
each case the blocks are reported only once no send out of them is in flight.

The lease bounds everything, releases included: when it runs out with sends still
in flight, the decode side has stopped reading (it died, or its own transfer deadline,
which is shorter than the lease, made it give up and cancel its receives). Those sends
are then *abandoned* and the blocks released. A decode rank's `Abort` says the same
sooner (it is sent once that rank's receives ended), so the sends to it are abandoned
on arrival: a pull served late (this side was paused while the decode side gave up)
does not hold its blocks for a whole lease. They cannot be cancelled: with error
handling off, UCX has no forced endpoint close, and a flushing close would wait on
the silent peer forever. Abandoning is safe because a decode side past its deadline
never uses what it receives, and its own blocks stay quarantined until its receives
end. The abandoned requests (and their buffers) are kept until UCX completes them.

A hold names the decode instance and epoch the gateway handed the request to; a pull,
`Done`, `Heartbeat` or `Abort` about it from any other life (a fenced decode instance
that went on before it was killed, its predecessor, the instance before a role switch,
a connection that never said `Hello`) is dropped and counted (`stale_epoch`), so it
never touches blocks held for another. Replies leave in this instance's epoch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.kvtransfer.control import ControlServer, drop_stale
from pdserve.kvtransfer.layout import KVLayoutMismatch, check_compatible, check_tp_split
from pdserve.kvtransfer.messages import (
    Abort,
    ControlEnvelope,
    ControlMessage,
    Done,
    Heartbeat,
    Hello,
    HelloReply,
    HoldSpec,
    Pull,
    PullRejected,
)
from pdserve.kvtransfer.rank_io import RankIO
from pdserve.kvtransfer.transport import TransferOp

logger = logging.getLogger(__name__)

Report = Callable[[str, str], None]  # (kind, request_id)


@dataclass
class _Serving:
    """One pull being served to one decode rank."""

    peer: bytes
    transfer_id: int
    ops: list[TransferOp]
    started: float
    error: str | None = None
    sent: bool = False  # every message left; waiting for the decode side's Done
    # The decode side's Done came before this side saw its sends complete (the receiver
    # can finish first): the entry stays until they do, so they are counted and closed.
    confirmed: bool = False

    @property
    def in_flight(self) -> bool:
        return not self.sent and not all(op.poll() for op in self.ops)


@dataclass
class _Held:
    request_id: str
    block_ids: frozenset[int]
    deadline: float
    decode_id: str  # the decode instance, in the epoch, that may pull and release it
    decode_epoch: int
    serving: dict[tuple[bytes, int], _Serving] = field(default_factory=dict)
    delivered_heads: set[int] = field(default_factory=set)
    release: str | None = None  # "finished_sending" | "expired" | "aborted"

    @property
    def sends_in_flight(self) -> bool:
        return any(s.in_flight for s in self.serving.values())


class PrefillKVServer:
    """Serves the pulls of a prefill instance's requests from this rank's KV memory; built
    on the rank's transfer I/O thread (`KVTransferWorker(serve=PrefillKVServer)`)."""

    def __init__(self, rank: RankIO, server: ControlServer, report: Report):
        self._heads = rank.heads  # a property: computed once here
        self._rank = rank
        self._server = server
        self._report = report
        self._peers: dict[bytes, Hello] = {}  # handshakes accepted
        self._senders: dict[bytes, str] = {}  # every connection's decode instance, by Hello
        self._held: dict[str, _Held] = {}
        # Held requests that need a look each poll (sends in flight, or being released);
        # the others only need their lease checked, at _lease_check_at.
        self._active: set[str] = set()
        self._lease_check_at = math.inf
        # Pulls that beat their hold: (deadline, peer, epoch, pull).
        self._parked: list[tuple[float, bytes, int, Pull]] = []
        self._abandoned: list[TransferOp] = []  # sends given up on, kept until UCX ends them

    # ---- commands from the instance -------------------------------------------------

    def hold(self, spec: HoldSpec, now: float) -> None:
        if spec.request_id in self._held:
            return
        deadline = now + self._rank.config.lease_s
        self._held[spec.request_id] = _Held(
            spec.request_id, frozenset(spec.block_ids), deadline, spec.decode_id, spec.decode_epoch
        )
        self._lease_check_at = min(self._lease_check_at, deadline)

    def abort(self, request_id: str, now: float) -> None:
        held = self._held.get(request_id)
        if held is not None and held.release is None:
            held.release = "aborted"
            self._active.add(request_id)
        self._parked = [p for p in self._parked if p[3].request_id != request_id]

    # ---- control messages -----------------------------------------------------------

    def on_message(self, peer: bytes, envelope: ControlEnvelope, now: float) -> None:
        message, epoch = envelope.message, envelope.epoch
        if isinstance(message, Hello):
            self._on_hello(peer, message)
        elif isinstance(message, Pull):
            self._on_pull(peer, message, epoch, now)
        elif isinstance(message, Done):
            held = self._held.get(message.request_id)
            if held is not None and self._from_holder(peer, held, message, epoch):
                self._on_done(peer, held, message)
        elif isinstance(message, Heartbeat):
            for request_id in message.request_ids:
                held = self._held.get(request_id)
                if held is None or held.release is not None:
                    continue
                if self._from_holder(peer, held, message, epoch):
                    held.deadline = now + self._rank.config.lease_s
        elif isinstance(message, Abort):
            # The decode rank sends it only once its receives ended (completed or
            # cancelled): nothing of ours can land in its blocks any more, so our sends
            # to it are abandoned now rather than when the lease runs out.
            held = self._held.get(message.request_id)
            if held is None:  # only its own pulls that beat the hold go with it
                key = (peer, message.request_id)
                self._parked = [p for p in self._parked if (p[1], p[3].request_id) != key]
            elif self._from_holder(peer, held, message, epoch):
                self._abandon_sends(held, f"the decode side gave up ({message.reason})", peer)
                self.abort(message.request_id, now)
        else:
            logger.warning("unexpected %s on the serving socket", type(message).__name__)

    def _from_holder(self, peer: bytes, held: _Held, message: ControlMessage, epoch: int) -> bool:
        """Whether `message` about `held` comes from the decode life its hold names."""
        sender = self._senders.get(peer)
        if (sender, epoch) == (held.decode_id, held.decode_epoch):
            return True
        who = f"decode instance {sender}" if sender else f"a connection without Hello {peer!r}"
        wanted = f"{held.request_id} is held for {held.decode_id} in epoch {held.decode_epoch}"
        drop_stale(message, who, epoch, wanted)
        return False

    def _on_hello(self, peer: bytes, hello: Hello) -> None:
        name = f"decode instance {hello.instance_id} rank {hello.tp_rank}"
        self._senders[peer] = hello.instance_id  # refused or not: whose messages these are
        error = ""
        try:
            check_compatible(self._rank.layout, hello.layout, name)
            check_tp_split(hello.layout, hello.tp_size, name)
            if hello.pp_stage != self._rank.pp_stage:
                error = (
                    f"pipeline stage mismatch: {name} holds stage {hello.pp_stage}'s layers, "
                    f"this rank stage {self._rank.pp_stage}'s"
                )
            elif hello.transport != self._rank.transport.name:
                error = (
                    f"KV transport mismatch: {name} uses {hello.transport}, prefill instance "
                    f"{self._rank.config.instance_id} uses {self._rank.transport.name}"
                )
        except KVLayoutMismatch as exc:
            error = str(exc)
        if not error:
            self._peers[peer] = hello
            self._rank.transport.add_peer(peer.hex(), hello.transport_info, hello.host)
        reply = HelloReply(*self._rank.introduction(), error, self._rank.pp_stage)
        self._server.send(peer, reply, self._rank.epoch)

    def _reject(self, peer: bytes, pull: Pull, reason: str) -> None:
        rejected = PullRejected(pull.request_id, pull.transfer_id, reason)
        self._server.send(peer, rejected, self._rank.epoch)

    def _on_pull(self, peer: bytes, pull: Pull, epoch: int, now: float) -> None:
        if peer not in self._peers:
            self._reject(peer, pull, "unknown peer: handshake first")
            return
        held = self._held.get(pull.request_id)
        if held is None:
            if self._rank.config.pull_grace_s > 0:
                self._parked.append((now + self._rank.config.pull_grace_s, peer, epoch, pull))
            else:
                self._reject(peer, pull, self._unknown(pull.request_id))
            return
        if not self._from_holder(peer, held, pull, epoch):
            return
        if held.release is not None:
            reason = f"request {pull.request_id} is being released ({held.release})"
            self._reject(peer, pull, reason)
            return
        error = self._validate(held, pull)
        if error:
            self._reject(peer, pull, error)
            return
        if (peer, pull.transfer_id) in held.serving:
            return  # a duplicate
        lo, hi = self._heads
        host = self._rank.memory.is_cuda and not self._rank.transport.moves_device_memory
        whole = (pull.head_start, pull.head_end) == (lo, hi) and not host
        ops: list[TransferOp] = []
        serving = _Serving(peer, pull.transfer_id, ops, time.perf_counter())
        held.serving[(peer, pull.transfer_id)] = serving
        held.deadline = max(held.deadline, now + self._rank.config.lease_s)
        self._active.add(held.request_id)
        self._rank.stats.in_flight += 1
        try:
            if whole:
                buffers = [self._rank.memory.blocks(run.src_start, run.count) for run in pull.runs]
            else:
                starts = [(run.src_start, run.count) for run in pull.runs]
                buffers = self._rank.memory.gather_runs(
                    starts, pull.head_start - lo, pull.head_end - lo, host
                )
            for run, buffer in zip(pull.runs, buffers, strict=True):
                ops.append(self._rank.transport.send(peer.hex(), buffer, run.tag))
        except Exception as exc:  # e.g. the peer's address is unreachable
            serving.error = f"prefill side could not send: {exc}"

    def _unknown(self, request_id: str) -> str:
        return (
            f"prefill instance {self._rank.config.instance_id} does not hold request {request_id} "
            "(never handed off, aborted, or its lease expired)"
        )

    def _validate(self, held: _Held, pull: Pull) -> str:
        lo, hi = self._heads
        if not lo <= pull.head_start < pull.head_end <= hi:
            return f"heads [{pull.head_start}, {pull.head_end}) are not on this rank ([{lo}, {hi}))"
        for run in pull.runs:
            blocks = range(run.src_start, run.src_start + run.count)
            if run.count < 1 or not held.block_ids.issuperset(blocks):
                return f"blocks {list(blocks)} are not held for request {held.request_id}"
        return ""

    def _on_done(self, peer: bytes, held: _Held, done: Done) -> None:
        key = (peer, done.transfer_id)
        serving = held.serving.get(key)
        if serving is not None and serving.sent:
            del held.serving[key]
        elif serving is not None:
            serving.confirmed = True
            self._active.add(held.request_id)
        held.delivered_heads.update(range(done.head_start, done.head_end))
        lo, hi = self._heads
        if held.release is None and held.delivered_heads.issuperset(range(lo, hi)):
            held.release = "finished_sending"
            self._active.add(held.request_id)

    # ---- timers and completions -----------------------------------------------------

    def poll(self, now: float) -> None:
        if self._parked:
            self._serve_parked(now)
        if now >= self._lease_check_at:
            self._lease_check_at = math.inf
            for held in self._held.values():
                if now >= held.deadline:
                    self._active.add(held.request_id)
                else:
                    self._lease_check_at = min(self._lease_check_at, held.deadline)
        for request_id in list(self._active):
            held = self._held[request_id]
            self._finish_sends(held)
            if now >= held.deadline:
                if held.release is None:
                    held.release = "expired"
                    self._rank.stats.lease_expiries_total += 1
                self._abandon_sends(held, "its lease ran out")
            if held.release is not None and not held.sends_in_flight:
                del self._held[request_id]
                self._active.discard(request_id)
                self._report(held.release, request_id)
            elif held.release is None and all(s.sent for s in held.serving.values()):
                self._active.discard(request_id)  # quiet until Done, abort or lease

    def _serve_parked(self, now: float) -> None:
        parked, self._parked = self._parked, []
        for deadline, peer, epoch, pull in parked:
            if pull.request_id in self._held:
                self._on_pull(peer, pull, epoch, now)
            elif now >= deadline:
                self._reject(peer, pull, self._unknown(pull.request_id))
            else:
                self._parked.append((deadline, peer, epoch, pull))

    def _finish_sends(self, held: _Held) -> None:
        for key, serving in list(held.serving.items()):
            if serving.sent or serving.in_flight:
                continue
            self._rank.stats.in_flight -= 1
            errors = [op.error for op in serving.ops if op.error]
            if serving.error or errors:
                del held.serving[key]
                reason = serving.error or f"prefill side send failed: {errors[0]}"
                rejected = PullRejected(held.request_id, key[1], reason)
                self._server.send(serving.peer, rejected, self._rank.epoch)
                self._rank.stats.failures_total += 1
                continue
            self._rank.stats.bytes_total += sum(op.nbytes for op in serving.ops)
            self._rank.stats.transfers_total += 1
            self._rank.stats.observe_seconds(time.perf_counter() - serving.started)
            serving.sent = True
            serving.ops = []  # lets go of staging buffers; the entry waits for Done
            if serving.confirmed:
                del held.serving[key]

    def _abandon_sends(self, held: _Held, why: str, peer: bytes | None = None) -> None:
        """Gives up the sends still in flight (to `peer` only, if given)."""
        for key, serving in list(held.serving.items()):
            if serving.in_flight and peer in (None, serving.peer):
                logger.warning(
                    "%s: %s with %d sends in flight to %r; abandoning them",
                    held.request_id,
                    why,
                    sum(not op.done for op in serving.ops),
                    serving.peer,
                )
                self._abandoned.extend(op for op in serving.ops if not op.done)
                self._rank.stats.in_flight -= 1
                self._rank.stats.failures_total += 1
                del held.serving[key]
        self._abandoned = [op for op in self._abandoned if not op.poll()]

    def next_deadline(self) -> float | None:
        deadlines = [self._lease_check_at, *(p[0] for p in self._parked)]
        if self._active:
            deadlines.append(min(self._held[r].deadline for r in self._active))
        return min(deadlines, default=None)

    @property
    def num_held(self) -> int:
        return len(self._held)
