"""The worker half of the connector: one per TP rank, owning that rank's KV memory.

All network work happens on a dedicated I/O thread (a long prefill chunk
must never starve a lease or a transfer): the UCX worker in blocking-progress mode,
the ZMQ control sockets, heartbeats and timers, waited on together in one poller.
The instance talks to it through two calls per step:

    worker.apply(metadata)          # holds / keepalives / pulls / aborts from the driver
    report = worker.get_finished()  # what finished since the last call

Both are cheap and never block on the network. `apply` is called on the rank's compute
thread before the step's model work: a plan that brings holds or pulls marks the work
launched so far there (the steps that wrote the held blocks or last used the blocks a
pull receives into), and the I/O thread takes them in only once that work is done
(`device_order.py`; on a CUDA device an event, on the host nothing to wait for).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import zmq

from pdserve.common.messages import KVPullTimes
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.control import ControlServer
from pdserve.kvtransfer.device_order import DeviceOrder, Marker
from pdserve.kvtransfer.kv_memory import KVMemory
from pdserve.kvtransfer.layout import check_tp_split
from pdserve.kvtransfer.messages import KVConnectorMetadata, KVLayout, TransferReport
from pdserve.kvtransfer.metrics import KVTransferStats
from pdserve.kvtransfer.rank_io import (
    NoPulling,
    NoServing,
    Pulling,
    PullingFactory,
    RankIO,
    Serving,
    ServingFactory,
)
from pdserve.kvtransfer.transport import Transport, make_transport

logger = logging.getLogger(__name__)

_MAX_WAIT_S = 0.1  # upper bound on one poll, so stop() is noticed promptly
_ids = itertools.count()


class KVTransferWorker:
    def __init__(
        self,
        config: KVTransferConfig,
        kv_storage: Any,
        layout: KVLayout,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_stage: int = 0,
        stage_layers: int | None = None,
        serve: ServingFactory | None = None,
        pull: PullingFactory | None = None,
        order: DeviceOrder | None = None,
    ):
        """`kv_storage`: this rank's KV tensor (torch, CPU or CUDA) or numpy array in
        the engine layout [num_blocks, layers, 2, kv_heads/tp_size, block_size, head_dim];
        with pipeline stages, stage `pp_stage`'s `stage_layers` layers. `serve` builds
        the side that serves pulls (a prefill instance's), `pull` the side that pulls (a
        decode instance's), both on the I/O thread; a side not given does nothing.
        `order`: how the storage's device work is ordered against the transport (by
        default what its device needs: `device_order.order_for`)."""
        check_tp_split(layout, tp_size, f"instance {config.instance_id}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} outside TP size {tp_size}")
        self.config = config
        self.layout = layout
        self.tp_rank, self.tp_size, self.pp_stage = tp_rank, tp_size, pp_stage
        self._serve, self._pull = serve, pull
        self._memory = KVMemory(kv_storage, layout, tp_size, stage_layers, order)
        self._lock = threading.Lock()
        # Each batch with the marker its holds and pulls wait for (None: it has neither).
        self._commands: list[tuple[KVConnectorMetadata, Marker | None]] = []
        self._report = TransferReport()
        self._stats = KVTransferStats()  # mutated by the I/O thread only
        self._quarantined: list[str] = []
        self._has_report = threading.Event()
        self._error: str | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._wake_address = f"inproc://kvtransfer-wake-{next(_ids)}"
        self._context = zmq.Context()
        self._wake: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._address = ""
        self._transport_info = b""

    # ---- lifecycle ------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> KVTransferWorker:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(
            target=self._run, name=f"kvtransfer-io-{self.tp_rank}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.close()
            raise TimeoutError(f"KV transfer I/O thread not ready within {timeout_s:g}s")
        if self._error:
            self.close()
            raise RuntimeError(f"KV transfer I/O thread failed to start: {self._error}")
        self._wake = self._context.socket(zmq.PAIR)
        self._wake.connect(self._wake_address)
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._wake is not None:
            self._wake.close(linger=0)
            self._wake = None
        if self._thread is not None and self._thread.is_alive():
            # Its sockets are still open: terminating the context would hang.
            logger.error("KV transfer I/O thread did not stop within 5s; leaving it")
            return
        self._context.term()

    def __enter__(self) -> KVTransferWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def control_address(self) -> str:
        """tcp://host:port of this rank's control socket (goes into KVSource)."""
        return self._address

    @property
    def transport_info(self) -> bytes:
        return self._transport_info

    # ---- per-step calls from the instance -------------------------------------------

    def apply(self, metadata: KVConnectorMetadata) -> None:
        if metadata.is_empty:
            return
        touches_blocks = bool(metadata.holds or metadata.pulls)
        written = self._memory.order.mark_compute() if touches_blocks else None
        with self._lock:
            self._commands.append((metadata, written))
            if self._wake is not None:
                self._wake.send(b"", zmq.NOBLOCK)

    def get_finished(self) -> TransferReport:
        """What finished since the last call; raises once the I/O thread is gone, so
        every step of the instance fails and its circuit breaker trips."""
        thread = self._thread
        with self._lock:
            if self._error:
                raise RuntimeError(f"KV transfer I/O thread failed: {self._error}")
            if thread is not None and not thread.is_alive() and not self._stop.is_set():
                raise RuntimeError("KV transfer I/O thread died")
            report, self._report = self._report, TransferReport()
            report.quarantined = list(self._quarantined)
            self._has_report.clear()
            return report

    def wait(self, timeout_s: float) -> bool:
        """Block until something can be reported (or the I/O thread failed), at most
        `timeout_s`; for an instance with nothing else to do this step."""
        return self._has_report.wait(timeout_s)

    def stats(self) -> KVTransferStats:
        # Fields are plain ints and floats written by one thread: a copy may straddle
        # an update, which is fine for metrics deltas.
        return self._stats.copy()

    # ---- the I/O thread -------------------------------------------------------------

    def _record(
        self, kind: str, request_id: str, reason: str = "", pull: KVPullTimes | None = None
    ) -> None:
        with self._lock:
            if kind == "failed":
                self._report.failed[request_id] = reason
            else:
                getattr(self._report, kind).append(request_id)
            if pull is not None:
                self._report.pulls[request_id] = pull
            self._has_report.set()

    def _run(self) -> None:
        transport: Transport | None = None
        server: ControlServer | None = None
        decode: Pulling | None = None
        wake = self._context.socket(zmq.PAIR)
        try:
            wake.bind(self._wake_address)
            transport = make_transport(
                self.config.transport, self.config.host, self.config.ucx_tls, self._context
            )
            server = ControlServer(self._context, self.config.host, self.config.control_port)
            self._address, self._transport_info = server.address, transport.info
            rank = RankIO(
                config=self.config,
                layout=self.layout,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                memory=self._memory,
                transport=transport,
                stats=self._stats,
                pp_stage=self.pp_stage,
                epoch=self.config.epoch,
            )
            prefill = self._serve(rank, server, self._record) if self._serve else NoServing()
            decode = self._pull(rank, self._context, self._record) if self._pull else NoPulling()
            self._ready.set()
            self._loop(wake, rank, server, prefill, decode)
        except Exception as exc:
            logger.exception("KV transfer I/O thread failed")
            with self._lock:
                self._error = f"{type(exc).__name__}: {exc}"
            self._ready.set()
            self._has_report.set()
        finally:
            if decode is not None:
                decode.close()
            if transport is not None:
                transport.close()
            if server is not None:
                server.close()
            wake.close(linger=0)

    def _loop(
        self,
        wake: zmq.Socket,
        rank: RankIO,
        server: ControlServer,
        prefill: Serving,
        decode: Pulling,
    ) -> None:
        transport = rank.transport
        poller = zmq.Poller()
        for handle in [wake, server.socket, *transport.poll_handles()]:
            poller.register(handle, zmq.POLLIN)
        registered: set[zmq.Socket] = set()
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                commands, self._commands = self._commands, []
            for metadata, written in commands:
                if written is not None:
                    written.synchronize()  # the steps launched before this plan
                rank.epoch = metadata.epoch  # what this batch's messages carry
                for hold in metadata.holds:
                    prefill.hold(hold, now)
                for keepalive in metadata.keepalives:
                    decode.keepalive(keepalive, now)
                for pull in metadata.pulls:
                    decode.pull(pull, now)
                for request_id in metadata.aborts:
                    prefill.abort(request_id, now)
                    decode.abort(request_id)
            for peer, message in server.receive():
                prefill.on_message(peer, message, now)
            decode.receive(now)
            transport.progress()
            prefill.poll(now)
            decode.poll(now)
            quarantined = decode.quarantined()
            if quarantined or self._quarantined:
                with self._lock:
                    self._quarantined = quarantined
            sockets = set(decode.sockets())
            for socket in sockets - registered:
                poller.register(socket, zmq.POLLIN)
            for socket in registered - sockets:
                poller.unregister(socket)
            registered = sockets
            if not transport.ready_to_block():
                continue  # UCX has events queued: progress again at once
            deadlines = [d for d in (prefill.next_deadline(), decode.next_deadline()) if d]
            wait = min([_MAX_WAIT_S, *(d - time.monotonic() for d in deadlines)])
            for socket, _ in poller.poll(max(0, int(wait * 1000))):
                if socket is wake:
                    while wake.poll(0):
                        wake.recv()
