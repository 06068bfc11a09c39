"""Workers in this process, real sockets and real UCX: leases, rejections, timeouts,
cancellation, and misbehaving peers."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pdserve.common.frame_drops import DROPS
from pdserve.decode.kv_puller import DecodeKVPuller
from pdserve.kvtransfer import (
    KVConnectorMetadata,
    KVLayout,
    KVSource,
    KVTransferConfig,
    KVTransferWorker,
    TransferReport,
)
from pdserve.kvtransfer.messages import Heartbeat, HoldSpec, KeepaliveSpec, Pull, PullSpec
from pdserve.prefill.kv_server import PrefillKVServer
from tests.kvtransfer.fakes import FakeDecode, FakePrefill, FakeUcx

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
SHAPE = (24, 2, 2, 2, 4, 16)
FAST = {"lease_s": 1.5, "heartbeat_interval_s": 0.2, "transfer_timeout_s": 1.0,
        "handshake_timeout_s": 0.5, "pull_grace_s": 0.3}  # fmt: skip


def _storage(seed: int | None) -> np.ndarray:
    if seed is None:
        return np.zeros(SHAPE, dtype=np.float32)
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


@pytest.fixture
def make_worker():
    workers: list[KVTransferWorker] = []

    def make(name: str, seed: int | None = None, **config) -> tuple[KVTransferWorker, np.ndarray]:
        storage = _storage(seed)
        settings = {**FAST, **config}
        config = KVTransferConfig(name, **settings)
        worker = KVTransferWorker(
            config, storage, LAYOUT, serve=PrefillKVServer, pull=DecodeKVPuller
        ).start()
        workers.append(worker)
        return worker, storage

    yield make
    for worker in workers:
        worker.close()


def collect(
    workers: dict[str, KVTransferWorker], done, timeout: float
) -> dict[str, TransferReport]:
    """Merge each worker's reports until `done(reports)`."""
    merged = {name: TransferReport() for name in workers}
    deadline = time.monotonic() + timeout
    while not done(merged):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not done within {timeout}s: {merged}")
        for name, worker in workers.items():
            report, acc = worker.get_finished(), merged[name]
            for kind in ("finished_sending", "expired", "finished_recving", "aborted"):
                getattr(acc, kind).extend(getattr(report, kind))
            acc.failed.update(report.failed)
            acc.quarantined = report.quarantined or acc.quarantined
        time.sleep(0.01)
    return merged


def _source(worker: KVTransferWorker, blocks: list[int]) -> KVSource:
    return KVSource("p", [worker.control_address], blocks, LAYOUT)


@pytest.mark.parametrize("transport", ["zmq", "ucx"])
def test_pull_moves_blocks_bit_exact(make_worker, transport):
    p, p_kv = make_worker("p", seed=1, transport=transport)
    d, d_kv = make_worker("d", transport=transport)
    src, dst = [5, 6, 7, 11, 2], [0, 1, 2, 20, 9]
    p.apply(KVConnectorMetadata(holds=[HoldSpec("r", src, "d", 0)]))
    d.apply(KVConnectorMetadata(pulls=[PullSpec("r", _source(p, src), src, dst)]))
    reports = collect(
        {"p": p, "d": d},
        lambda r: r["d"].finished_recving and r["p"].finished_sending,
        timeout=10,
    )
    assert reports["d"].finished_recving == ["r"] and reports["p"].finished_sending == ["r"]
    np.testing.assert_array_equal(d_kv[dst], p_kv[src])
    untouched = [b for b in range(SHAPE[0]) if b not in dst]
    assert not d_kv[untouched].any()
    stats = d.stats()
    assert stats.bytes_total == len(src) * d_kv[0].nbytes and stats.seconds_count == 1


def test_lease_expires_when_no_decode_side_comes(make_worker):
    p, _ = make_worker("p", seed=1)
    p.apply(KVConnectorMetadata(holds=[HoldSpec("lonely", [1, 2], "d", 0)]))
    start = time.monotonic()
    reports = collect({"p": p}, lambda r: r["p"].expired, timeout=5)
    assert reports["p"].expired == ["lonely"]
    assert FAST["lease_s"] <= time.monotonic() - start < FAST["lease_s"] + 1.0
    assert p.stats().lease_expiries_total == 1


def test_heartbeats_keep_a_queued_request_alive(make_worker):
    """D keeps a request queued for longer than the lease, then pulls it."""
    p, p_kv = make_worker("p", seed=1)
    d, d_kv = make_worker("d")
    p.apply(KVConnectorMetadata(holds=[HoldSpec("patient", [3, 4], "d", 0)]))
    source = _source(p, [3, 4])
    d.apply(KVConnectorMetadata(keepalives=[KeepaliveSpec("patient", source)]))
    time.sleep(FAST["lease_s"] * 1.5)
    assert p.get_finished().expired == []
    d.apply(KVConnectorMetadata(pulls=[PullSpec("patient", source, [3, 4], [8, 9])]))
    collect({"p": p, "d": d}, lambda r: r["p"].finished_sending, timeout=5)
    np.testing.assert_array_equal(d_kv[[8, 9]], p_kv[[3, 4]])


def test_pull_may_overtake_its_hold(make_worker):
    p, p_kv = make_worker("p", seed=1)
    d, d_kv = make_worker("d")
    d.apply(KVConnectorMetadata(pulls=[PullSpec("early", _source(p, [7]), [7], [1])]))
    time.sleep(0.1)
    p.apply(KVConnectorMetadata(holds=[HoldSpec("early", [7], "d", 0)]))
    collect({"p": p, "d": d}, lambda r: r["d"].finished_recving, timeout=5)
    np.testing.assert_array_equal(d_kv[1], p_kv[7])


def test_pull_of_an_aborted_request_is_rejected(make_worker):
    p, _ = make_worker("p", seed=1)
    d, d_kv = make_worker("d")
    p.apply(KVConnectorMetadata(holds=[HoldSpec("gone", [1, 2], "d", 0)]))
    p.apply(KVConnectorMetadata(aborts=["gone"]))
    collect({"p": p}, lambda r: r["p"].aborted, timeout=5)
    d.apply(KVConnectorMetadata(pulls=[PullSpec("gone", _source(p, [1, 2]), [1, 2], [3, 4])]))
    reports = collect({"d": d}, lambda r: r["d"].failed, timeout=5)
    assert "does not hold request gone" in reports["d"].failed["gone"]
    assert not d_kv.any()


def test_handshake_timeout_is_a_clear_failure(make_worker):
    d, _ = make_worker("d")
    silent = FakePrefill(LAYOUT)
    silent.socket.close(linger=0)  # bound address, nobody answering
    try:
        source = KVSource("ghost", [silent.address], [0], LAYOUT)
        d.apply(KVConnectorMetadata(pulls=[PullSpec("r", source, [0], [0])]))
        reports = collect({"d": d}, lambda r: r["d"].failed, timeout=5)
        assert "no handshake reply from prefill instance ghost rank 0" in reports["d"].failed["r"]
    finally:
        silent.context.term()


def test_transport_mismatch_is_refused_at_handshake(make_worker):
    p, _ = make_worker("p", seed=1, transport="zmq")
    d, _ = make_worker("d", transport="ucx")
    p.apply(KVConnectorMetadata(holds=[HoldSpec("r", [1], "d", 0)]))
    d.apply(KVConnectorMetadata(pulls=[PullSpec("r", _source(p, [1]), [1], [1])]))
    reports = collect({"d": d}, lambda r: r["d"].failed, timeout=5)
    assert "KV transport mismatch" in reports["d"].failed["r"]


def test_timed_out_pull_is_quarantined_then_failed_and_others_still_arrive(make_worker):
    """A silent prefill rank: the first pull times out and its receives are cancelled;
    a second pull from the same rank, in flight meanwhile, still lands bit-exact."""
    d, d_kv = make_worker("d", transfer_timeout_s=1.0, lease_s=5.0)
    fake = FakePrefill(LAYOUT)
    ucx = FakeUcx()
    try:
        source = KVSource("fake-p", [fake.address], [0, 1, 2], LAYOUT)
        d.apply(KVConnectorMetadata(pulls=[PullSpec("stuck", source, [0, 1], [4, 5])]))
        fake.serve(0.5)
        d.apply(KVConnectorMetadata(pulls=[PullSpec("late", source, [2], [10])]))
        fake.serve(0.2)
        pulls = {m.request_id: m for m in fake.received if isinstance(m, Pull)}
        assert set(pulls) == {"stuck", "late"}
        reports = collect({"d": d}, lambda r: r["d"].failed, timeout=5)
        assert "timed out after 1s" in reports["d"].failed["stuck"]
        # Only now does the silent rank send the second pull's block.
        payload = np.random.default_rng(3).integers(0, 256, d_kv[0].nbytes, dtype=np.uint8)
        run = pulls["late"].runs[0]
        ucx.progress_until([ucx.send(fake.hellos[0].transport_info, payload, run.tag)], 5)
        collect({"d": d}, lambda r: r["d"].finished_recving == ["late"], timeout=5)
        assert d_kv[10].tobytes() == payload.tobytes()
        assert not d_kv[[4, 5]].any()
        assert d.stats().failures_total == 1
    finally:
        fake.close()


def test_lease_bounds_sends_to_a_decode_side_that_stopped_reading(make_worker):
    """The decode side pulls two requests, then never progresses UCX again, so the
    sends can never complete. It heartbeats only one: the other's lease runs out and
    its sends are abandoned (it expires). The decode side's Abort of the heartbeated
    one (sent once its receives ended) abandons that one's sends at once."""
    p, _ = make_worker("p", seed=1, lease_s=1.0, heartbeat_interval_s=0.2,
                       transfer_timeout_s=0.5, handshake_timeout_s=0.5)  # fmt: skip
    big = SHAPE[0] // 2
    holds = [HoldSpec("a", list(range(big)), "fake-d", 0),
             HoldSpec("b", list(range(big, 2 * big)), "fake-d", 0)]  # fmt: skip
    p.apply(KVConnectorMetadata(holds=holds))
    fake = FakeDecode(LAYOUT, p.control_address, FakeUcx())
    try:
        assert fake.handshake().error == ""
        fake.send(Pull("a", 1, 0, 2, [_run(0, big, tag=100)]))
        fake.send(Pull("b", 2, 0, 2, [_run(big, big, tag=200)]))
        time.sleep(0.2)
        assert p.stats().in_flight == 2
        cpu = time.process_time()
        deadline = time.monotonic() + 1.4
        while time.monotonic() < deadline:
            fake.send(Heartbeat(["b"]))
            time.sleep(0.1)
        assert time.process_time() - cpu < 0.7  # stuck sends do not make the I/O thread spin
        reports = collect({"p": p}, lambda r: r["p"].expired, timeout=3)
        assert reports["p"].expired == ["a"]
        stats = p.stats()
        assert stats.in_flight == 1 and stats.lease_expiries_total == 1
        fake.send(Heartbeat(["b"]))  # b's lease is renewed: only the Abort releases it
        fake.send(_abort("b"))
        reports = collect({"p": p}, lambda r: r["p"].aborted, timeout=0.5)  # < b's lease
        assert reports["p"].aborted == ["b"]
        assert p.stats().in_flight == 0
    finally:
        fake.close()


def _run(start: int, count: int, tag: int):
    from pdserve.kvtransfer.messages import BlockRun

    return BlockRun(start, count, tag)


def _abort(request_id: str):
    from pdserve.kvtransfer.messages import Abort

    return Abort(request_id, "test")


def test_a_dead_io_thread_fails_every_report(make_worker):
    # The instance's steps then fail, and its circuit breaker trips (instance/breaker.py).
    worker, _ = make_worker("p")
    assert worker.get_finished() == TransferReport()
    alive = worker._thread
    gone = threading.Thread(target=lambda: None)
    gone.start()
    gone.join()
    worker._thread = gone  # as if the I/O thread had ended on its own
    try:
        with pytest.raises(RuntimeError, match="I/O thread died"):
            worker.get_finished()
    finally:
        worker._thread = alive


def stale_drops() -> int:
    return DROPS.totals().get(("kv_control", "stale_epoch"), 0)


def test_a_pull_from_a_decode_life_its_hold_does_not_name_moves_nothing(make_worker):
    p, _ = make_worker("p", seed=1)
    d, d_kv = make_worker("d")
    before = stale_drops()
    p.apply(KVConnectorMetadata(holds=[HoldSpec("r", [1, 2], "d", 1)]))  # d's epoch 1
    spec = PullSpec("r", _source(p, [1, 2]), [1, 2], [3, 4])
    d.apply(KVConnectorMetadata(epoch=0, pulls=[spec]))  # d's retired epoch 0
    reports = collect({"d": d}, lambda r: r["d"].failed, timeout=5)
    assert "timed out" in reports["d"].failed["r"]
    assert not d_kv.any() and p.stats().bytes_total == 0
    assert stale_drops() >= before + 2  # its pull and its abort
    assert p.get_finished().aborted == []  # still held for epoch 1


def test_a_reply_from_an_older_epoch_of_the_prefill_instance_is_dropped(make_worker):
    d, _ = make_worker("d")
    stale = FakePrefill(LAYOUT, epoch=1)  # a life of fake-p retired since
    before = stale_drops()
    try:
        source = KVSource("fake-p", [stale.address], [0], LAYOUT, epoch=2)
        d.apply(KVConnectorMetadata(pulls=[PullSpec("r", source, [0], [0])]))
        stale.serve(0.3)
        reports = collect({"d": d}, lambda r: r["d"].failed, timeout=5)
        assert "no handshake reply from prefill instance fake-p" in reports["d"].failed["r"]
        assert stale.hellos and stale_drops() == before + 1
    finally:
        stale.close()
