"""Two real processes moving KV over UCX shared memory (UCX_TLS pinned to "sm,self").

The prefill child holds random KV in several model layouts (one of them a torch
`KVCache` in bfloat16, the embedded model's shape); the decode child pulls requests
into non-contiguous blocks, and every (block, head) must arrive bit-exact. UCX's own
protocol report (UCX_PROTO_INFO) must show shared-memory lanes only, so a copy
through anything else would fail the test. Heterogeneous TP runs here too.
"""

from __future__ import annotations

import re

import pytest

from pdserve.kvtransfer import KVLayout
from tests.kvtransfer.cluster import Instance, admit_and_pull, hand_off, run_until
from tests.kvtransfer.peer import logical_kv

pytestmark = pytest.mark.slow

SM_ENV = {"UCX_TLS": "sm,self", "UCX_PROTO_INFO": "y"}
CONFIG = {"transport": "ucx"}
SMOL = KVLayout(block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16")
TINY = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
WIDE = KVLayout(block_size=16, num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16")
HETERO = KVLayout(block_size=8, num_layers=3, num_kv_heads=4, head_dim=16, dtype="float32")
SHAPES = {"smol": (SMOL, "torch"), "tiny": (TINY, "numpy"), "wide": (WIDE, "numpy")}
NUM_BLOCKS = 64

LANE = re.compile(r"\|\s*([a-z0-9_]+)/[a-z0-9_:.\-]+\s*\|")


def ucx_lanes(log: str) -> set[str]:
    """Transport names in UCX's protocol-selection tables (UCX_PROTO_INFO=y)."""
    return set(LANE.findall(log))


@pytest.fixture(scope="module")
def pair(peer_factory):
    p_peer, d_peer = peer_factory("p-shm", SM_ENV), peer_factory("d-shm", SM_ENV)
    p, d = {}, {}
    for key, (layout, backend) in SHAPES.items():
        p[key] = Instance.start(p_peer, f"p-{key}", "prefill", layout, NUM_BLOCKS, CONFIG,
                                seed=11, backend=backend)  # fmt: skip
        d[key] = Instance.start(d_peer, f"d-{key}", "decode", layout, NUM_BLOCKS, CONFIG,
                                backend=backend)  # fmt: skip
    for tp in (1, 2):
        p[f"tp{tp}"] = Instance.start(p_peer, f"p-tp{tp}", "prefill", HETERO, 32, CONFIG,
                                      tp_size=tp, seed=5)  # fmt: skip
        d[f"tp{tp}"] = Instance.start(d_peer, f"d-tp{tp}", "decode", HETERO, 32, CONFIG,
                                      tp_size=tp)  # fmt: skip
    yield p, d, p_peer, d_peer


def _all_ready(rids):
    return lambda o: set(o.decode.ready) == set(rids) and set(o.prefill.released) == set(rids)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_bit_exact_over_shared_memory(pair, shape):
    p_all, d_all, _, d_peer = pair
    p, d = p_all[shape], d_all[shape]
    block_size = p.layout.block_size
    lengths = {"one-token": 1, "odd": 3 * block_size + 5, "long": 14 * block_size}
    src, dst = {}, {}
    for name, length in lengths.items():
        rid = f"{shape}-{name}"
        handoff = hand_off(p, d, rid, length)
        src[rid] = handoff.source.block_ids
        dst[rid] = admit_and_pull(d, handoff)
    assert any(b - a != 1 for ids in dst.values() for a, b in zip(ids, ids[1:], strict=False))
    run_until(p, d, _all_ready(src), timeout=30)
    for rid in src:
        assert d.digests(dst[rid]) == p.digests(src[rid]), rid
        d.pool.free(rid)
    assert p.pool.num_free == d.pool.num_free == NUM_BLOCKS
    stats = d.stats()
    assert stats["bytes_total"] == sum(len(v) for v in src.values()) * p.layout.bytes_per_block
    assert stats["in_flight"] == 0
    lanes = ucx_lanes(d_peer.log()) | ucx_lanes(pair[2].log())
    assert lanes, "UCX reported no protocol lanes"
    assert lanes <= {"cma", "sysv", "posix", "xpmem", "knem", "self"}, lanes


def test_only_missing_blocks_are_pulled(pair):
    """Local prefix-cache hits stay as they are; only the rest crosses."""
    p, d = pair[0]["tiny"], pair[1]["tiny"]
    handoff = hand_off(p, d, "cached", 6 * TINY.block_size)
    dst = admit_and_pull(d, handoff, cached_tokens=2 * TINY.block_size)
    run_until(p, d, _all_ready(["cached"]), timeout=30)
    zero = d.digests([dst[0]])  # never written: all-zero content
    assert d.digests(dst[:2]) == zero * 2
    assert d.digests(dst[2:]) == p.digests(handoff.source.block_ids[2:])
    d.pool.free("cached")
    assert p.pool.num_free == d.pool.num_free == NUM_BLOCKS


def test_fully_cached_prompt_releases_prefill_without_data(pair):
    p, d = pair[0]["tiny"], pair[1]["tiny"]
    handoff = hand_off(p, d, "all-cached", 2 * TINY.block_size)
    before = d.stats()["bytes_total"]
    admit_and_pull(d, handoff, cached_tokens=2 * TINY.block_size)
    run_until(p, d, _all_ready(["all-cached"]), timeout=30)
    assert d.stats()["bytes_total"] == before
    d.pool.free("all-cached")
    assert p.pool.num_free == d.pool.num_free == NUM_BLOCKS


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_heterogeneous_tp_reassembles_the_same_kv(pair, p_tp, d_tp):
    p, d = pair[0][f"tp{p_tp}"], pair[1][f"tp{d_tp}"]
    rid = f"hetero-{p_tp}-{d_tp}"
    handoff = hand_off(p, d, rid, 9 * HETERO.block_size + 3)
    dst = admit_and_pull(d, handoff)
    run_until(p, d, _all_ready([rid]), timeout=30)
    # Expected: the prefill side's logical KV (all heads), whatever its TP split.
    full = logical_kv(_as_dict(HETERO), 32, seed=5)
    import hashlib

    expected = [
        [hashlib.sha256(full[b, :, :, h].tobytes()).hexdigest() for h in range(4)]
        for b in handoff.source.block_ids
    ]
    assert d.digests(dst) == expected
    d.pool.free(rid)
    assert p.pool.num_free == 32 and d.pool.num_free == 32


def _as_dict(layout: KVLayout) -> dict:
    import msgspec

    return msgspec.structs.asdict(layout)
