"""Two real processes moving KV over UCX TCP (UCX_TLS pinned to "tcp,self").

Worker-address endpoints and listener endpoints both; UCX's protocol report must show
TCP lanes only. A third process whose UCX may use shared memory only cannot be
reached from a TCP-only prefill process: that pull must fail with a clear reason,
which shows nothing but UCX carries the bytes.
"""

from __future__ import annotations

import pytest

from pdserve.kvtransfer import KVLayout
from tests.kvtransfer.cluster import Instance, admit_and_pull, hand_off, run_until
from tests.kvtransfer.test_transfer_shm import ucx_lanes

pytestmark = pytest.mark.slow

TCP_ENV = {"UCX_TLS": "tcp,self", "UCX_PROTO_INFO": "y"}
LAYOUTS = {
    "small": KVLayout(block_size=16, num_layers=6, num_kv_heads=2, head_dim=64, dtype="float32"),
    "fp16": KVLayout(block_size=8, num_layers=3, num_kv_heads=4, head_dim=32, dtype="float16"),
}
NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def peers(peer_factory):
    return peer_factory("p-tcp", TCP_ENV), peer_factory("d-tcp", TCP_ENV)


def _ready(rids):
    return lambda o: set(o.decode.ready) == set(rids) and set(o.prefill.released) == set(rids)


@pytest.mark.parametrize("transport", ["ucx", "ucx-listener"])
@pytest.mark.parametrize("shape", list(LAYOUTS))
def test_bit_exact_over_tcp(peers, transport, shape):
    p_peer, d_peer = peers
    layout, config = LAYOUTS[shape], {"transport": transport}
    name = f"{shape}-{transport}"
    p = Instance.start(p_peer, f"p-{name}", "prefill", layout, NUM_BLOCKS, config, seed=3)
    d = Instance.start(d_peer, f"d-{name}", "decode", layout, NUM_BLOCKS, config)
    rids, src, dst = [], {}, {}
    for i, length in enumerate([layout.block_size * 11 + 1, 2, layout.block_size * 20]):
        rid = f"{name}-{i}"
        handoff = hand_off(p, d, rid, length)
        rids.append(rid)
        src[rid], dst[rid] = handoff.source.block_ids, admit_and_pull(d, handoff)
    run_until(p, d, _ready(rids), timeout=60)
    for rid in rids:
        assert d.digests(dst[rid]) == p.digests(src[rid]), rid
        d.pool.free(rid)
    assert p.pool.num_free == d.pool.num_free == NUM_BLOCKS
    lanes = ucx_lanes(p_peer.log()) | ucx_lanes(d_peer.log())
    assert "tcp" in lanes and lanes <= {"tcp", "self"}, lanes


def test_unreachable_transport_fails_the_pull_clearly(peers, peer_factory):
    """P may use TCP only, D shared memory only: no UCX lane joins them, and no other
    path may carry the KV instead."""
    layout = LAYOUTS["small"]
    d_peer = peer_factory("d-sm-only", {"UCX_TLS": "sm,self"})
    config = {"transport": "ucx", "transfer_timeout_s": 5.0}
    p = Instance.start(peers[0], "p-island", "prefill", layout, NUM_BLOCKS, config, seed=4)
    d = Instance.start(d_peer, "d-island", "decode", layout, NUM_BLOCKS, config)
    handoff = hand_off(p, d, "island", layout.block_size * 3)
    admit_and_pull(d, handoff)
    outcomes = run_until(None, d, lambda o: o.decode.failed, timeout=15)
    failure = outcomes.decode.failed[0]
    assert failure.request_id == "island" and failure.policy == "recompute"
    assert "prefill side could not send" in failure.reason or "timed out" in failure.reason
    assert d.pool.num_free == NUM_BLOCKS
    assert d.stats()["failures_total"] == 1
    # D's Abort reaches P, which lets go of the blocks.
    run_until(p, None, lambda o: o.prefill.aborted == ["island"], timeout=10)
    assert p.pool.num_free == NUM_BLOCKS
