"""Failure paths between real processes; after each, every block on both sides is free.

Transfers here are large (256 MiB of 2 MiB blocks, the 8B layout) and go over UCX
TCP so they last long enough to interfere with: a process is killed or frozen once
the other side reports the transfer in flight.
"""

from __future__ import annotations

import signal
import time

import msgspec
import pytest

from pdserve.kvtransfer import KVLayout, KVLayoutMismatch
from tests.kvtransfer.cluster import Instance, Outcomes, admit_and_pull, hand_off, run_until, step
from tests.kvtransfer.peer import wait_for

pytestmark = pytest.mark.slow

TCP_ENV = {"UCX_TLS": "tcp,self"}
# Small TCP segments make a transfer stream for seconds instead of a fraction of one.
SLOW_TCP_ENV = TCP_ENV | {"UCX_TCP_TX_SEG_SIZE": "2k", "UCX_TCP_RX_SEG_SIZE": "2k"}
BIG = KVLayout(block_size=16, num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
NUM_BLOCKS = 136  # 272 MiB per side
REQUEST_TOKENS = 128 * BIG.block_size  # 128 blocks = 256 MiB


def _pair(fresh_peers, config, p_env=TCP_ENV, d_env=TCP_ENV):
    p_peer, d_peer = fresh_peers("p", p_env), fresh_peers("d", d_env)
    p = Instance.start(p_peer, "p", "prefill", BIG, NUM_BLOCKS, config, seed=9)
    d = Instance.start(d_peer, "d", "decode", BIG, NUM_BLOCKS, config)
    return p, d


def test_decode_killed_mid_pull_prefill_frees_at_lease_expiry(fresh_peers):
    config = {"lease_s": 2.0, "heartbeat_interval_s": 0.25, "transfer_timeout_s": 1.5,
              "handshake_timeout_s": 1.0}  # fmt: skip
    p, d = _pair(fresh_peers, config)
    admit_and_pull(d, hand_off(p, d, "victim", REQUEST_TOKENS))
    wait_for(lambda: p.stats()["in_flight"] > 0, timeout=20)
    d.peer.kill()
    killed = time.monotonic()
    outcomes = run_until(p, None, lambda o: o.prefill.expired, timeout=10)
    assert outcomes.prefill.expired == ["victim"] and not outcomes.prefill.released
    assert time.monotonic() - killed < config["lease_s"] + 2.0
    stats = p.stats()
    assert stats["lease_expiries_total"] == 1 and stats["in_flight"] == 0
    assert p.prefill.lease_expiries == 1
    assert p.pool.num_free == NUM_BLOCKS


@pytest.mark.parametrize("mid_message", [False, True], ids=["at-once", "mid-message"])
def test_prefill_killed_decode_fails_within_timeout(fresh_peers, mid_message):
    """Killed as its sends start, or while D is receiving the message (a receive UCX
    can no longer cancel: only the sender's death can end it)."""
    config = {"lease_s": 10.0, "transfer_timeout_s": 2.0, "handshake_timeout_s": 1.0}
    env = SLOW_TCP_ENV if mid_message else TCP_ENV
    p, d = _pair(fresh_peers, config, env, env)
    admit_and_pull(d, hand_off(p, d, "orphan", REQUEST_TOKENS))
    wait_for(lambda: d.stats()["in_flight"] > 0 and p.stats()["in_flight"] > 0, timeout=20)
    if mid_message:
        time.sleep(0.1)  # the message streams in small segments meanwhile
    p.peer.kill()
    pulled = time.monotonic()
    outcomes = run_until(None, d, lambda o: o.decode.failed or o.decode.ready, timeout=10)
    assert not outcomes.decode.ready, "the transfer ended before the prefill side died"
    assert time.monotonic() - pulled < config["transfer_timeout_s"] + 1.5
    failure = outcomes.decode.failed[0]
    assert failure.request_id == "orphan" and failure.policy == "recompute"
    assert failure.reason
    assert not outcomes.decode.ready
    stats = d.stats()
    assert stats["failures_total"] == 1 and stats["in_flight"] == 0
    assert d.pool.num_free == NUM_BLOCKS


def test_abort_during_transfer_reuses_no_block_before_it_ends(fresh_peers):
    config = {"lease_s": 20.0, "transfer_timeout_s": 10.0}
    p, d = _pair(fresh_peers, config)
    handoff = hand_off(p, d, "doomed", REQUEST_TOKENS)
    dst = admit_and_pull(d, handoff)
    wait_for(lambda: p.stats()["in_flight"] > 0, timeout=20)
    p.peer.signal(signal.SIGSTOP)  # the transfer cannot end while P is frozen
    try:
        d.decode.abort("doomed")
        d.push()
        outcomes = Outcomes()
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            step(None, d, outcomes)
            time.sleep(0.02)
        assert not outcomes.decode.aborted and not outcomes.decode.ready
        assert d.pool.num_free == NUM_BLOCKS - len(dst)  # still held: nothing to reuse
    finally:
        p.peer.signal(signal.SIGCONT)
    outcomes = run_until(p, d, lambda o: o.decode.aborted and o.prefill.aborted, timeout=20)
    assert outcomes.decode.aborted == ["doomed"] and outcomes.prefill.aborted == ["doomed"]
    # The transfer ran to its end before the blocks were let go...
    assert d.digests(dst) == p.digests(handoff.source.block_ids)
    # ...so a new owner of those blocks keeps what it writes.
    reused = d.pool.allocate("next", len(dst))
    assert set(reused) & set(dst)
    d.peer.call("fill", "d", 0, reused, 0x5A)
    pattern = d.digests(reused[:1])
    time.sleep(0.3)
    assert d.digests(reused) == pattern * len(reused)
    d.pool.free("next")
    assert p.pool.num_free == d.pool.num_free == NUM_BLOCKS


def test_mismatched_layout_is_a_clear_error_with_nothing_allocated(fresh_peers):
    config = {"lease_s": 10.0, "transfer_timeout_s": 2.0, "handshake_timeout_s": 1.0}
    p_peer, d_peer = fresh_peers("p"), fresh_peers("d")
    small = KVLayout(block_size=16, num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32")
    other = msgspec.structs.replace(small, head_dim=128)
    p = Instance.start(p_peer, "p", "prefill", small, 16, config, seed=2)
    d = Instance.start(d_peer, "d", "decode", other, 16, config)
    handoff = hand_off(p, d, "alien", 40)
    # The handoff says what P's layout is: refused before any block is allocated.
    with pytest.raises(KVLayoutMismatch, match="head_dim 64 there vs 128 here"):
        d.decode.admit(handoff)
    # A handoff that lies about P's layout is caught by the handshake, still before
    # the request is allocated (it is only queued, kept alive).
    forged = msgspec.structs.replace(
        handoff, source=msgspec.structs.replace(handoff.source, layout=other)
    )
    d.decode.admit(forged)
    d.push()
    outcomes = run_until(None, d, lambda o: o.decode.failed, timeout=10)
    failure = outcomes.decode.failed[0]
    assert failure.request_id == "alien"
    assert "KV layout mismatch" in failure.reason and "head_dim" in failure.reason
    assert d.pool.num_free == 16
    p.prefill.abort("alien")
    p.push()
    run_until(p, None, lambda o: o.prefill.aborted, timeout=10)
    assert p.pool.num_free == 16
