"""KV moves ordered against UCX, which reads and writes device memory outside every CUDA
stream: a recording order in place of CUDA events shows that a gathered head slice is
done before UCX is handed it, that a received slice is scattered and done before its
pull is reported, and that holds and pulls wait for the steps launched before them.
`CudaOrder` itself runs against a recording stand-in of torch's CUDA streams and
events, chosen for a fake CUDA KV cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from torch._subclasses.fake_tensor import FakeTensorMode

from pdserve.decode.kv_puller import DecodeKVPuller
from pdserve.kvtransfer import KVTransferConfig, KVTransferStats
from pdserve.kvtransfer.device_order import CudaOrder, HostOrder, order_for
from pdserve.kvtransfer.kv_memory import KVMemory
from pdserve.kvtransfer.messages import (
    BlockRun,
    HoldSpec,
    KVConnectorMetadata,
    KVSource,
    Pull,
    PullSpec,
)
from pdserve.kvtransfer.rank_io import NoPulling, NoServing, RankIO
from pdserve.kvtransfer.transport import TransferOp
from pdserve.kvtransfer.worker import KVTransferWorker
from pdserve.kvtransfer.zmq_transport import _host_view
from pdserve.prefill.kv_server import PrefillKVServer
from tests.kvtransfer.fakes import FakePrefill
from tests.kvtransfer.manual_transport import (
    LAYOUT,
    PEER,
    HeldOp,
    ManualTransport,
    RecordingServer,
    hello,
    sent,
)

SHAPE = (8, 2, 2, 2, 4, 8)  # blocks, layers, K/V, kv heads, block size, head dim


class RecordingMarker:
    def __init__(self, log: list[str], what: str) -> None:
        self.log, self.what = log, what

    def synchronize(self) -> None:
        self.log.append(f"{self.what} synchronized on {threading.current_thread().name}")


class RecordingOrder:
    """A `DeviceOrder` that writes down what the transfer asks of it, in order."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def mark_compute(self) -> RecordingMarker:
        self.log.append(f"compute marked on {threading.current_thread().name}")
        return RecordingMarker(self.log, "compute")

    @contextmanager
    def copying(self) -> Iterator[None]:
        self.log.append("transfer stream")
        yield
        self.log.append("compute stream")

    def mark_copies(self) -> RecordingMarker:
        self.log.append("copies marked")
        return RecordingMarker(self.log, "copies")


class LoggedMemory(KVMemory):
    def __init__(self, storage: Any, log: list[str], **kwargs: Any) -> None:
        super().__init__(storage, LAYOUT, order=RecordingOrder(log), **kwargs)
        self.log = log

    def gather(self, start: int, count: int, head_lo: int, head_hi: int, host: bool = False) -> Any:
        self.log.append(f"gather {start}+{count}" + (" to host" if host else ""))
        return super().gather(start, count, head_lo, head_hi, host)

    def scatter(self, staging: Any, start: int, head_lo: int, head_hi: int) -> None:
        self.log.append(f"scatter {start}+{staging.shape[0]} heads {head_lo}:{head_hi}")
        super().scatter(staging, start, head_lo, head_hi)


class LoggedTransport(ManualTransport):
    """Sends and receives that complete when the test says so, written to the log."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.received: list[tuple[HeldOp, Any]] = []

    def send(self, peer: str, buffer: Any, tag: int) -> TransferOp:
        self.log.append(f"UCX send {buffer.nbytes} bytes")
        return super().send(peer, buffer, tag)

    def recv(self, buffer: Any, tag: int) -> TransferOp:
        self.log.append(f"UCX recv posted {buffer.nbytes} bytes")
        op = HeldOp(buffer.nbytes)
        self.received.append((op, buffer))
        return op


def _rank(instance_id: str, memory: KVMemory, transport: LoggedTransport) -> RankIO:
    config = KVTransferConfig(instance_id=instance_id)
    return RankIO(config, LAYOUT, 0, 1, memory, transport, KVTransferStats())


def test_a_head_slice_is_gathered_and_done_before_ucx_is_handed_it() -> None:
    log: list[str] = []
    storage = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    transport = LoggedTransport(log)
    rank = _rank("p", LoggedMemory(storage, log), transport)
    side = PrefillKVServer(rank, RecordingServer(), lambda kind, rid: None)
    side.hold(HoldSpec("r", [2, 3, 5], "d", 0), now=0.0)
    side.on_message(PEER, hello(tp_size=2), now=0.0)
    # A decode rank of TP 2 wants head 0 of this rank's two: a strided slice, gathered.
    side.on_message(PEER, sent(Pull("r", 7, 0, 1, [BlockRun(2, 2, 1), BlockRun(5, 1, 2)])), now=0.1)
    half_block = LAYOUT.bytes_per_block // 2
    assert log == [
        "transfer stream",
        "gather 2+2",
        "gather 5+1",
        "compute stream",
        "copies marked",
        "copies synchronized on MainThread",
        f"UCX send {2 * half_block} bytes",
        f"UCX send {half_block} bytes",
    ]
    log.clear()
    # Whole blocks go out as views of the cache: no copy to wait for.
    side.on_message(PEER, sent(Pull("r", 8, 0, 2, [BlockRun(2, 2, 3)])), now=0.2)
    assert log == [f"UCX send {2 * LAYOUT.bytes_per_block} bytes"]


def _wait_for(condition, what: str, poke=lambda: None, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        poke()
        time.sleep(0.01)


def test_a_received_head_slice_is_scattered_and_done_before_its_pull_is_reported() -> None:
    log: list[str] = []
    storage = np.zeros(SHAPE, dtype=np.float32)
    transport = LoggedTransport(log)
    rank = _rank("d", LoggedMemory(storage, log), transport)
    prefills = [FakePrefill(LAYOUT, "p", tp_rank=r, tp_size=2) for r in (0, 1)]
    context = zmq.Context()
    puller = DecodeKVPuller(
        rank, context, lambda kind, rid, why, pull=None: log.append(f"reported {kind}")
    )
    try:
        # The prefill instance runs TP 2: one head from each rank, each into a staging
        # buffer scattered into this rank's two heads.
        source = KVSource("p", [p.address for p in prefills], [0, 1], LAYOUT)
        puller.pull(PullSpec("r", source, [0, 1], [4, 5]), now=0.0)
        for prefill in prefills:
            prefill.serve(0.2)  # the handshakes
        posted = lambda: len(transport.received) == 2  # noqa: E731
        _wait_for(posted, "both receives", lambda: puller.receive(0.0))
        for value, (_, buffer) in enumerate(transport.received, start=1):
            buffer[...] = np.full(buffer.shape, value, np.uint8)  # what UCX wrote
        log.append("UCX receives complete")
        for op, _ in transport.received:
            op.complete = True
        puller.poll(now=0.1)
    finally:
        puller.close()
        context.term()
        for prefill in prefills:
            prefill.close()
    scattered = [
        "transfer stream",
        "scatter 4+2 heads {}",
        "compute stream",
        "copies marked",
        "copies synchronized on MainThread",
    ]
    half_run = LAYOUT.bytes_per_block  # two blocks, one head of two
    assert log == [
        f"UCX recv posted {half_run} bytes",
        f"UCX recv posted {half_run} bytes",
        "UCX receives complete",
        *(line.format("0:1") for line in scattered),
        *(line.format("1:2") for line in scattered),
        "reported finished_recving",
    ]
    as_bytes = storage.view(np.uint8).reshape(*SHAPE[:4], -1)
    assert (as_bytes[4:6, :, :, 0] == 1).all() and (as_bytes[4:6, :, :, 1] == 2).all()
    assert not as_bytes[:4].any() and not as_bytes[6:].any()


class DeviceView:
    """What a CUDA cache's views are to a transport: not host memory."""

    def __init__(self, host: np.ndarray) -> None:
        self.host, self.nbytes, self.shape = host, host.nbytes, host.shape


class DeviceLikeMemory(LoggedMemory):
    """KV memory standing for a CUDA cache: a torch tensor taken through `KVMemory`'s
    CUDA paths (on the host, so values can be read; host buffers are not pinned, which
    a CPU build cannot do); its block views and device buffers are `DeviceView`s."""

    def __init__(self, storage: torch.Tensor, log: list[str]) -> None:
        super().__init__(storage, log)
        self.is_cuda = True
        self._bytes = torch.from_numpy(self._bytes)  # what the CUDA branch keeps

    def blocks(self, start: int, count: int) -> Any:
        return DeviceView(super().blocks(start, count).numpy())

    def gather(self, start: int, count: int, head_lo: int, head_hi: int, host: bool = False) -> Any:
        got = super().gather(start, count, head_lo, head_hi, host)
        return got if host else DeviceView(got.numpy())

    def staging(self, count: int, num_heads: int, host: bool = False) -> Any:
        self.log.append(f"staging {count} blocks" + (" in host memory" if host else ""))
        got = super().staging(count, num_heads, host)
        return got if host else DeviceView(got.numpy())

    def scatter(self, staging: Any, start: int, head_lo: int, head_hi: int) -> None:
        assert isinstance(staging, np.ndarray), "a device staging buffer in this test"
        super().scatter(staging, start, head_lo, head_hi)

    def _pinned(self, shape: tuple[int, ...]) -> Any:
        return torch.empty(shape, dtype=torch.uint8)


class HostOnlyTransport(LoggedTransport):
    """Refuses device memory as the zmq transport does."""

    moves_device_memory = False

    def send(self, peer: str, buffer: Any, tag: int) -> TransferOp:
        return super().send(peer, _host_view(buffer), tag)

    def recv(self, buffer: Any, tag: int) -> TransferOp:
        return super().recv(_host_view(buffer), tag)


def _prefill_side(memory: KVMemory, transport: LoggedTransport) -> PrefillKVServer:
    side = PrefillKVServer(_rank("p", memory, transport), RecordingServer(), lambda k, r: None)
    side.hold(HoldSpec("r", [2, 3, 5], "d", 0), now=0.0)
    side.on_message(PEER, hello(), now=0.0)
    return side


def test_a_host_only_transport_sends_a_cuda_cache_through_host_copies() -> None:
    # Seen on an H200: `--kv-transport zmq` with the KV cache on the GPU failed every
    # handoff ("the zmq KV transport moves host memory only").
    log: list[str] = []
    storage = torch.arange(np.prod(SHAPE), dtype=torch.float32).reshape(SHAPE)
    transport = HostOnlyTransport(log)
    side = _prefill_side(DeviceLikeMemory(storage, log), transport)
    side.on_message(PEER, sent(Pull("r", 7, 0, 2, [BlockRun(2, 2, 1)])), now=0.1)
    assert log == [
        "transfer stream",
        "gather 2+2 to host",
        "compute stream",
        "copies marked",
        "copies synchronized on MainThread",
        f"UCX send {2 * LAYOUT.bytes_per_block} bytes",
    ]
    (op,) = transport.sent
    assert op.nbytes == 2 * LAYOUT.bytes_per_block


def test_a_transport_that_moves_device_memory_gets_the_cache_itself() -> None:
    log: list[str] = []
    storage = torch.zeros(SHAPE, dtype=torch.float32)
    transport = LoggedTransport(log)
    transport.moves_device_memory = True
    side = _prefill_side(DeviceLikeMemory(storage, log), transport)
    side.on_message(PEER, sent(Pull("r", 7, 0, 2, [BlockRun(2, 2, 1)])), now=0.1)
    assert log == [f"UCX send {2 * LAYOUT.bytes_per_block} bytes"]  # a view: no copy


def test_a_host_only_transport_receives_into_host_staging_then_the_cuda_cache() -> None:
    log: list[str] = []
    storage = torch.zeros(SHAPE, dtype=torch.float32)
    transport = HostOnlyTransport(log)
    rank = _rank("d", DeviceLikeMemory(storage, log), transport)
    prefill = FakePrefill(LAYOUT, "p")
    context = zmq.Context()
    puller = DecodeKVPuller(
        rank, context, lambda kind, rid, why, pull=None: log.append(f"reported {kind}: {why}")
    )
    try:
        source = KVSource("p", [prefill.address], [0], LAYOUT)
        puller.pull(PullSpec("r", source, [0, 1], [4, 5]), now=0.0)
        prefill.serve(0.2)  # the handshake
        _wait_for(lambda: transport.received, "the receive", lambda: puller.receive(0.0))
        ((op, buffer),) = transport.received
        buffer[...] = np.full(buffer.shape, 9, np.uint8)  # what the transport wrote
        op.complete = True
        puller.poll(now=0.1)
    finally:
        puller.close()
        context.term()
        prefill.close()
    assert log == [
        "staging 2 blocks in host memory",
        f"UCX recv posted {2 * LAYOUT.bytes_per_block} bytes",
        "transfer stream",
        "scatter 4+2 heads 0:2",
        "compute stream",
        "copies marked",
        "copies synchronized on MainThread",
        "reported finished_recving: ",
    ]
    as_bytes = storage.numpy().view(np.uint8).reshape(*SHAPE[:4], -1)
    assert (as_bytes[4:6] == 9).all() and not as_bytes[:4].any() and not as_bytes[6:].any()


class LoggedServing(NoServing):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def hold(self, spec: HoldSpec, now: float) -> None:
        self.log.append(f"hold {spec.request_id}")


class LoggedPulling(NoPulling):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def pull(self, spec: PullSpec, now: float) -> None:
        self.log.append(f"pull {spec.request_id}")

    def abort(self, request_id: str) -> None:
        self.log.append(f"abort {request_id}")


def test_holds_and_pulls_wait_for_the_steps_launched_before_them() -> None:
    log: list[str] = []
    config = KVTransferConfig(instance_id="x", transport="zmq", host="127.0.0.1")
    worker = KVTransferWorker(
        config,
        np.zeros(SHAPE, dtype=np.float32),
        LAYOUT,
        serve=lambda rank, server, report: LoggedServing(log),
        pull=lambda rank, context, report: LoggedPulling(log),
        order=RecordingOrder(log),
    )
    source = KVSource("p", ["tcp://127.0.0.1:1"], [0], LAYOUT)
    with worker:
        worker.apply(KVConnectorMetadata(holds=[HoldSpec("h", [1], "d", 0)]))
        _wait_for(lambda: "hold h" in log, "the hold")
        worker.apply(KVConnectorMetadata(aborts=["gone"]))  # touches no block: no marker
        _wait_for(lambda: "abort gone" in log, "the abort")
        worker.apply(KVConnectorMetadata(pulls=[PullSpec("q", source, [0], [3])]))
        _wait_for(lambda: "pull q" in log, "the pull")
    io = f"kvtransfer-io-{worker.tp_rank}"
    assert log == [
        "compute marked on MainThread",
        f"compute synchronized on {io}",
        "hold h",
        "abort gone",
        "compute marked on MainThread",
        f"compute synchronized on {io}",
        "pull q",
    ]


class FakeCuda:
    """torch.cuda's streams and events as `CudaOrder` uses them, written down."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, log: list[str]) -> None:
        compute = self.Stream("compute")
        fake = self

        class Event:
            def record(self, stream: FakeCuda.Stream) -> None:
                log.append(f"event recorded on {stream.name}")

            def synchronize(self) -> None:
                log.append("event synchronized")

        @contextmanager
        def stream(chosen: FakeCuda.Stream) -> Iterator[None]:
            log.append(f"current stream {chosen.name}")
            yield
            log.append(f"current stream {compute.name}")

        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: fake.Stream("transfer"))
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
        monkeypatch.setattr(torch.cuda, "stream", stream)

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name


def test_cuda_order_records_events_on_the_compute_and_the_transfer_stream(monkeypatch) -> None:
    log: list[str] = []
    FakeCuda(monkeypatch, log)
    assert isinstance(order_for(np.zeros(SHAPE, np.float32)), HostOrder)
    assert isinstance(order_for(torch.zeros(SHAPE)), HostOrder)
    with FakeTensorMode():
        storage = torch.empty(SHAPE, dtype=torch.float32, device="cuda")
        order = KVMemory(storage, LAYOUT).order
    assert isinstance(order, CudaOrder)
    order.mark_compute().synchronize()
    with order.copying():
        log.append("a copy")
    order.mark_copies().synchronize()
    assert log == [
        "event recorded on compute",
        "event synchronized",
        "current stream transfer",
        "a copy",
        "current stream compute",
        "event recorded on transfer",
        "event synchronized",
    ]
