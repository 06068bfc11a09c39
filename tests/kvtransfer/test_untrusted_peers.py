"""A peer without the deployment secret on a prefill rank's KV control socket: its
handshake goes unanswered, its pulls send no byte and its heartbeats renew no lease;
each refusal is logged."""

from __future__ import annotations

import logging
import time

import pytest

from pdserve.common.frame_seal import KV_CONTROL, Sealer
from pdserve.kvtransfer.messages import Heartbeat, HoldSpec, KVConnectorMetadata, Pull
from tests.kvtransfer.fakes import FakeDecode, FakeUcx
from tests.kvtransfer.test_worker import LAYOUT, _run, collect, make_worker  # noqa: F401


def test_a_stranger_cannot_handshake_pull_or_keep_a_lease(make_worker, caplog) -> None:  # noqa: F811
    p, _ = make_worker("p", seed=1)
    p.apply(KVConnectorMetadata(holds=[HoldSpec("a", [0, 1], "fake-d", 0)]))
    stranger = FakeDecode(LAYOUT, p.control_address, FakeUcx())
    stranger.sealer = Sealer(KV_CONTROL, "fake-d", secret=b"not the deployment's secret")
    held_at = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.common.frame_seal"):
            with pytest.raises(TimeoutError):
                stranger.handshake(timeout=0.5)
            stranger.send(Pull("a", 1, 0, 2, [_run(0, 2, tag=100)]))
            stranger.socket.send(b"\x92no mac at all")
            for _ in range(5):
                stranger.send(Heartbeat(["a"]))
                time.sleep(0.2)
            # The lease (1.5 s) ran out as if nobody had called.
            reports = collect({"p": p}, lambda r: r["p"].expired, timeout=3)
        assert reports["p"].expired == ["a"]
        assert time.monotonic() - held_at < 3.0
        stats = p.stats()
        assert stats.bytes_total == 0 and stats.transfers_total == 0 and stats.in_flight == 0
        assert "dropped a kv_control frame from KV peer" in caplog.text
    finally:
        stranger.close()
