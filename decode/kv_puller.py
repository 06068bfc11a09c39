"""The decode side of a rank's KV transfer I/O thread: handshakes, pulls, heartbeats,
deadlines.

For each request this rank receives one *slice* per prefill rank whose heads overlap
its own. A slice posts its receives (straight into the KV blocks when it covers all
of this rank's heads, else into a staging buffer scattered on arrival), then sends
the `Pull`. A request is reported exactly once, when none of its receives can still
write: finished (every slice arrived; P is told `Done`), failed (a rejection, an
error or the deadline; receives are cancelled and the request stays quarantined
until the cancels land; P is told `Abort`) or aborted (the instance gave up; an
in-flight pull runs to its end or deadline first). Every message leaves in the
instance's epoch as the rank last heard it (`RankIO.epoch`); a reply from an epoch of
the prefill instance older than its latest handoff named is dropped.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Protocol

import zmq

from pdserve.common.messages import KVPullTimes
from pdserve.decode.pull_state import PrefillRank, PullRequest, PullSlice
from pdserve.kvtransfer.control import ControlClient, drop_stale
from pdserve.kvtransfer.layout import (
    KVLayoutMismatch,
    check_compatible,
    check_tp_split,
    coalesce,
    source_slices,
)
from pdserve.kvtransfer.messages import (
    Abort,
    BlockRun,
    ControlEnvelope,
    Done,
    Heartbeat,
    Hello,
    HelloReply,
    KeepaliveSpec,
    KVSource,
    Pull,
    PullRejected,
    PullSpec,
)
from pdserve.kvtransfer.rank_io import RankIO

logger = logging.getLogger(__name__)


class Report(Protocol):
    """The worker's record of a request's outcome, with its pull's timing once done."""

    def __call__(
        self, kind: str, request_id: str, reason: str = "", pull: KVPullTimes | None = None
    ) -> None: ...


_TAG_BITS = 20  # message index bits inside a tag; the rest is the transfer id
_TRANSFER_ID_BITS = 64 - _TAG_BITS


def _new_transfer_id(live: dict[int, PullSlice]) -> int:
    """A random transfer id: the tags of a pull's receives come from it, and a tag
    nobody can guess is what keeps a stranger's UCX message out of KV memory (UCX has
    no MAC; the control plane that names the tags has one)."""
    while True:
        transfer_id = secrets.randbits(_TRANSFER_ID_BITS - 1) | 1  # never 0
        if transfer_id not in live:
            return transfer_id


class DecodeKVPuller:
    """Pulls a decode instance's handed-off requests into this rank's KV memory; built on
    the rank's transfer I/O thread (`KVTransferWorker(pull=DecodeKVPuller)`)."""

    def __init__(self, rank: RankIO, context: zmq.Context, report: Report):
        self._heads = rank.heads  # a property: computed once here
        self._rank = rank
        self._context = context
        self._report = report
        self._name = f"{self._rank.config.instance_id}/{self._rank.tp_rank}"
        self._requests: dict[str, PullRequest] = {}
        # Requests being pulled, failed or aborted: settled each poll. Queued ones
        # (keepalive only) just get heartbeats.
        self._active: set[str] = set()
        self._sources: dict[str, PrefillRank] = {}
        self._by_transfer: dict[int, PullSlice] = {}
        self._next_heartbeat = 0.0

    # ---- commands from the instance -------------------------------------------------

    def keepalive(self, spec: KeepaliveSpec, now: float) -> None:
        request = self._admit(spec.request_id, spec.source, now)
        if request is not None and request.failure is None:
            for address in request.addresses:
                self._handshake(self._sources[address], now)

    def pull(self, spec: PullSpec, now: float) -> None:
        request = self._admit(spec.request_id, spec.source, now)
        if request is None or request.deadline is not None or request.failure is not None:
            return
        request.deadline = now + self._rank.config.transfer_timeout_s
        self._active.add(request.request_id)
        try:
            runs = coalesce(spec.src_block_ids, spec.dst_block_ids)
            for run in runs:
                self._rank.memory.check_blocks(run.dst_start, run.count)
        except (ValueError, IndexError) as exc:
            self._fail(request, f"invalid pull for request {spec.request_id}: {exc}")
            return
        for piece in source_slices(
            self._rank.layout, self._rank.tp_rank, self._rank.tp_size, spec.source.tp_size
        ):
            address = spec.source.address_of(self._rank.pp_stage, piece.src_rank)
            part = PullSlice(
                request=request,
                address=address,
                src_rank=piece.src_rank,
                head_start=piece.start,
                head_end=piece.end,
                runs=runs,
            )
            request.slices.append(part)
            if not runs:
                part.state = "received"  # every block was in the local prefix cache
                continue
            source = self._sources[address]
            self._handshake(source, now)
            if source.state == "ready":
                self._start(part)
            else:
                part.state = "waiting"
                source.waiting.append(part)

    def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            request.aborted = True
            self._active.add(request_id)

    def _admit(self, request_id: str, source: KVSource, now: float) -> PullRequest | None:
        request = self._requests.get(request_id)
        if request is not None:
            return request
        pieces = []
        try:
            check_compatible(
                self._rank.layout, source.layout, f"prefill instance {source.instance_id}"
            )
            check_tp_split(source.layout, source.tp_size, f"prefill instance {source.instance_id}")
            pieces = source_slices(
                self._rank.layout, self._rank.tp_rank, self._rank.tp_size, source.tp_size
            )
        except KVLayoutMismatch as exc:
            request = PullRequest(request_id, source, [])
            self._requests[request_id] = request
            self._fail(request, str(exc))
            return request
        # The same stage's ranks there: this stage's layers, the overlapping heads.
        addresses = [source.address_of(self._rank.pp_stage, p.src_rank) for p in pieces]
        request = PullRequest(request_id, source, addresses)
        self._requests[request_id] = request
        for piece, address in zip(pieces, addresses, strict=True):
            if address not in self._sources:
                client = ControlClient(self._context, address, self._name)
                self._sources[address] = PrefillRank(
                    address,
                    piece.src_rank,
                    source.tp_size,
                    source.instance_id,
                    client,
                    pp_stage=self._rank.pp_stage,
                )
            rank = self._sources[address]
            rank.epoch = max(rank.epoch, source.epoch)
        return request

    # ---- handshake and pull ---------------------------------------------------------

    def _handshake(self, source: PrefillRank, now: float) -> None:
        hello = Hello(
            *self._rank.introduction(),
            self._rank.transport.info,
            self._rank.pp_stage,
            self._rank.config.host,
        )
        source.handshake(hello, now + self._rank.config.handshake_timeout_s, self._rank.epoch)

    def _start(self, part: PullSlice) -> None:
        request = part.request
        if request.failure is not None or request.aborted or request.finalized:
            part.state = "received"  # nothing will be posted for it
            return
        part.transfer_id = _new_transfer_id(self._by_transfer)
        self._by_transfer[part.transfer_id] = part
        lo, hi = self._heads
        host = self._rank.memory.is_cuda and not self._rank.transport.moves_device_memory
        whole = (part.head_start, part.head_end) == (lo, hi) and not host
        block_runs = []
        part.state = "receiving"
        if request.started is None:
            request.started = time.perf_counter()
            request.started_wall = time.time()
            self._rank.stats.in_flight += 1
        try:
            for index, run in enumerate(part.runs):
                tag = (part.transfer_id << _TAG_BITS) | index
                if whole:
                    buffer = self._rank.memory.blocks(run.dst_start, run.count)
                else:
                    width = part.head_end - part.head_start
                    buffer = self._rank.memory.staging(run.count, width, host)
                    part.stagings.append((buffer, run.dst_start))
                part.ops.append(self._rank.transport.recv(buffer, tag))
                block_runs.append(BlockRun(run.src_start, run.count, tag))
        except Exception as exc:
            self._fail(request, f"could not post receives: {exc}")
            return
        heads = (part.head_start, part.head_end)
        pull = Pull(request.request_id, part.transfer_id, *heads, block_runs)
        self._sources[part.address].client.send(pull, self._rank.epoch)

    # ---- control messages -----------------------------------------------------------

    def sockets(self) -> list[zmq.Socket]:
        return [s.client.socket for s in self._sources.values()]

    def receive(self, now: float) -> None:
        for source in list(self._sources.values()):
            for envelope in source.client.receive():
                self._on_message(source, envelope, now)

    def _on_message(self, source: PrefillRank, envelope: ControlEnvelope, now: float) -> None:
        message = envelope.message
        if envelope.epoch < source.epoch:
            drop_stale(message, source.name, envelope.epoch, f"a handoff named {source.epoch}")
            return
        if isinstance(message, HelloReply):
            self._on_hello_reply(source, message)
        elif isinstance(message, PullRejected):
            part = self._by_transfer.get(message.transfer_id)
            if message.reason.startswith("unknown peer"):
                self._reset(source)  # the prefill rank restarted: handshake again next time
            if part is not None and part.request.request_id == message.request_id:
                self._fail(part.request, f"{source.name}: {message.reason}")
        else:
            logger.warning("unexpected %s from %s", type(message).__name__, source.address)

    def _on_hello_reply(self, source: PrefillRank, reply: HelloReply) -> None:
        if source.state != "waiting":
            return
        error = source.refusal(reply, self._rank.layout)
        if error:
            self._fail_source(source, f"handshake failed: {error}")
            return
        source.state = "ready"
        waiting, source.waiting = source.waiting, []
        for part in waiting:
            self._start(part)

    def _fail_source(self, source: PrefillRank, reason: str) -> None:
        """Every request that needs this prefill rank fails, queued ones included, so a
        request still waiting for blocks is rejected before anything is allocated."""
        self._reset(source)
        for request in list(self._requests.values()):
            if source.address in request.addresses:
                self._fail(request, reason)

    def _reset(self, source: PrefillRank) -> None:
        source.reset(ControlClient(self._context, source.address, self._name))

    # ---- failure, completion, timers ------------------------------------------------

    def _fail(self, request: PullRequest, reason: str) -> None:
        if request.failure is not None:
            return
        request.failure = reason
        self._active.add(request.request_id)
        in_flight = [op for part in request.slices if part.in_flight for op in part.ops]
        if in_flight:
            self._rank.transport.cancel_recvs(in_flight)

    def poll(self, now: float) -> None:
        for source in self._sources.values():
            if source.state == "waiting" and now >= source.hello_deadline:
                self._fail_source(
                    source,
                    f"no handshake reply from {source.name} at "
                    f"{source.address} within {self._rank.config.handshake_timeout_s:g}s",
                )
        for request_id in list(self._active):
            request = self._requests.get(request_id)
            if request is None:
                self._active.discard(request_id)
                continue
            if request.deadline is not None and now >= request.deadline:
                self._fail(
                    request,
                    f"timed out after {self._rank.config.transfer_timeout_s:g}s waiting for KV "
                    f"from prefill instance {request.source.instance_id}",
                )
            self._settle(request)
        if now >= self._next_heartbeat:
            self._heartbeat()
            self._next_heartbeat = now + self._rank.config.heartbeat_interval_s

    def _settle(self, request: PullRequest) -> None:
        for part in request.slices:
            if part.state == "receiving" and not part.in_flight:
                part.state = "received"
                errors = [op.error for op in part.ops if op.error]
                if errors:
                    self._fail(request, f"receive failed: {errors[0]}")
                elif request.failure is None and part.stagings:
                    lo = self._heads[0]
                    heads = (part.head_start - lo, part.head_end - lo)
                    self._rank.memory.scatter_runs(part.stagings, *heads)
                part.stagings = []
        if request.in_flight:
            return
        received = bool(request.slices) and all(p.state == "received" for p in request.slices)
        if request.failure is None and not request.aborted and not received:
            return  # still waiting for the pull or the handshake
        self._finalize(request)

    def _finalize(self, request: PullRequest) -> None:
        request.finalized = True
        del self._requests[request.request_id]
        self._active.discard(request.request_id)
        for part in request.slices:
            self._by_transfer.pop(part.transfer_id, None)
        if request.started is not None:
            self._rank.stats.in_flight -= 1
        if request.failure is None and not request.aborted:
            for part in request.slices:
                done = Done(request.request_id, part.transfer_id, part.head_start, part.head_end)
                self._sources[part.address].client.send(done, self._rank.epoch)
            moved = sum(op.nbytes for p in request.slices for op in p.ops)
            self._rank.stats.bytes_total += moved
            self._rank.stats.transfers_total += 1
            if request.started is not None:
                self._rank.stats.observe_seconds(time.perf_counter() - request.started)
            ended = time.time()
            started = ended if request.started_wall is None else request.started_wall
            pull = KVPullTimes(started, ended, moved, self._rank.transport.name)
            self._report("finished_recving", request.request_id, "", pull)
            return
        reason = "aborted" if request.aborted else (request.failure or "")
        for address in request.addresses:
            self._sources[address].client.send(Abort(request.request_id, reason), self._rank.epoch)
        if request.aborted:
            self._report("aborted", request.request_id, "")
        else:
            self._rank.stats.failures_total += 1
            self._report("failed", request.request_id, reason)

    def _heartbeat(self) -> None:
        wanted: dict[str, list[str]] = {}
        for request in self._requests.values():
            if request.failure is None and not request.aborted:
                for address in request.addresses:
                    wanted.setdefault(address, []).append(request.request_id)
        for address, request_ids in wanted.items():
            self._sources[address].client.send(Heartbeat(request_ids), self._rank.epoch)

    def next_deadline(self) -> float | None:
        deadlines = [self._next_heartbeat] if self._requests else []
        active = (self._requests[r] for r in self._active)
        deadlines += [r.deadline for r in active if r.deadline is not None]
        deadlines += [s.hello_deadline for s in self._sources.values() if s.state == "waiting"]
        return min(deadlines, default=None)

    def close(self) -> None:
        for source in self._sources.values():
            source.client.close()

    def quarantined(self) -> list[str]:
        requests = (self._requests[r] for r in self._active if r in self._requests)
        return [
            r.request_id for r in requests if (r.failure is not None or r.aborted) and r.in_flight
        ]
