from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.decode.kv_scheduler import DecodeKVScheduler
from pdserve.kvtransfer import (
    KVHandoff,
    KVLayout,
    KVLayoutMismatch,
    KVTransferConfig,
    KVTransferStats,
    ReportAggregator,
    TransferReport,
)
from pdserve.prefill.kv_scheduler import PrefillKVScheduler

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16")
TO = {"decode_id": "d0", "decode_epoch": 2}  # the decode life a hold names


def _request(rid: str = "r1", tokens: int = 10) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(100, 100 + tokens)),
        sampling_params=SamplingParams(temperature=0.7, seed=3, max_tokens=20),
        eos_token_ids=frozenset({2, 7}),
        cache_salt="tenant",
        seed=1234,
    )


def _prefill() -> PrefillKVScheduler:
    return PrefillKVScheduler("p0", LAYOUT, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])


def test_hand_off_holds_the_prompt_blocks_and_builds_the_message():
    p = _prefill()
    handoff = p.hand_off(_request(), [9, 3, 4, 8], 55, -0.25, {55: -0.25, 60: -2.0}, **TO)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(handoff), type=KVHandoff)
    assert wire == handoff
    assert wire.source.block_ids == [9, 3, 4]  # 10 tokens of block size 4
    assert wire.decode_epoch == 2  # the decode life it is routed to, as its hold names
    assert wire.source.tp_size == 2 and wire.sampling_params.temperature == 0.7
    assert (
        wire.eos_token_ids == [2, 7]
        and wire.sampling_params.seed == 1234
        and wire.cache_salt == "tenant"
    )
    assert wire.first_token_top_logprobs == {55: -0.25, 60: -2.0}
    metadata = p.build_metadata()
    holds = [(h.request_id, h.block_ids, h.decode_id, h.decode_epoch) for h in metadata.holds]
    assert holds == [("r1", [9, 3, 4], "d0", 2)]
    assert p.build_metadata().is_empty
    with pytest.raises(ValueError, match="already handed off"):
        p.hand_off(_request(), [1, 2, 3], 5, **TO)
    with pytest.raises(ValueError, match="2 blocks cannot hold 10 prompt tokens"):
        p.hand_off(_request("r2"), [1, 2], 5, **TO)


def test_a_handoff_carries_its_prefill_instances_epoch():
    p = PrefillKVScheduler("p0", LAYOUT, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], epoch=3)
    handoff = p.hand_off(_request(), [9, 3, 4], 55, **TO)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(handoff), type=KVHandoff).source.epoch == 3
    assert _prefill().hand_off(_request(), [9, 3, 4], 55, **TO).source.epoch == 0
    assert p.build_metadata().epoch == 3  # the ranks' control messages carry it


def test_a_decode_schedulers_metadata_carries_its_instances_epoch():
    d = DecodeKVScheduler(LAYOUT, epoch=4)
    d.admit(_prefill().hand_off(_request(), [1, 2, 3], 5, **TO))
    assert d.build_metadata().epoch == 4
    assert d.build_metadata().epoch == 4  # an empty one too


def test_prefill_update_releases_each_request_once():
    p = _prefill()
    for rid in ("a", "b", "c"):
        p.hand_off(_request(rid), [1, 2, 3], 5, **TO)
    p.abort("c")
    assert p.build_metadata().aborts == ["c"]
    update = p.update(TransferReport(finished_sending=["a", "zzz"], expired=["b"], aborted=["c"]))
    assert (update.released, update.expired, update.aborted) == (["a"], ["b"], ["c"])
    assert p.lease_expiries == 1 and not p.held_request_ids
    assert p.update(TransferReport(finished_sending=["a"])).released == []


def test_decode_admission_checks_before_allocation_and_pulls_only_misses():
    p = _prefill()
    handoff = p.hand_off(_request(tokens=14), [20, 21, 22, 23], 5, **TO)
    d = DecodeKVScheduler(LAYOUT, tp_size=4, failure_policy="fail")
    assert d.admit(handoff) == 14
    assert [k.request_id for k in d.build_metadata().keepalives] == ["r1"]
    allocation = SimpleNamespace(request_id="r1", block_ids=[5, 6, 7, 8], num_local_cached_tokens=8)
    assert d.on_allocation(allocation) == 2
    (pull,) = d.build_metadata().pulls
    assert (pull.src_block_ids, pull.dst_block_ids) == ([22, 23], [7, 8])
    update = d.update(TransferReport(failed={"r1": "timed out"}))
    assert [(f.request_id, f.reason, f.policy) for f in update.failed] == [
        ("r1", "timed out", "fail")
    ]


def test_request_that_failed_while_queued_pulls_nothing_once_allocated():
    d = DecodeKVScheduler(LAYOUT)
    d.admit(_prefill().hand_off(_request(), [1, 2, 3], 5, **TO))
    d.build_metadata()
    assert d.update(TransferReport(failed={"r1": "handshake failed"})).failed
    allocation = SimpleNamespace(request_id="r1", block_ids=[4, 5, 6], num_local_cached_tokens=0)
    assert d.on_allocation(allocation) is None
    assert d.build_metadata().is_empty


def test_decode_admission_refuses_a_foreign_layout():
    handoff = _prefill().hand_off(_request(), [1, 2, 3], 5, **TO)
    d = DecodeKVScheduler(msgspec.structs.replace(LAYOUT, num_layers=3))
    with pytest.raises(KVLayoutMismatch, match="num_layers 2 there vs 3 here"):
        d.admit(handoff)
    assert d.build_metadata().is_empty


def test_aggregator_waits_for_every_rank_and_keeps_the_worst_outcome():
    agg = ReportAggregator(world_size=2)
    agg.add(0, TransferReport(finished_recving=["ok", "mixed"], failed={"bad": "x"}))
    assert agg.pop().is_empty
    agg.add(1, TransferReport(finished_recving=["ok", "bad"], failed={"mixed": "rank 1 lost"}))
    merged = agg.pop()
    assert merged.finished_recving == ["ok"]
    assert merged.failed == {"mixed": "rank 1 lost", "bad": "x"}
    agg.add(0, TransferReport(finished_sending=["p"]))
    agg.add(1, TransferReport(expired=["p"], quarantined=["q"]))
    merged = agg.pop()
    assert merged.expired == ["p"] and merged.quarantined == ["q"]


def test_config_rejects_unsafe_timeouts_with_one_line():
    with pytest.raises(ValueError, match=r"transfer_timeout_s must be in \(0, lease_s\)"):
        KVTransferConfig("x", lease_s=5.0, transfer_timeout_s=5.0)
    with pytest.raises(ValueError, match="transport must be one of ucx, ucx-listener, zmq"):
        KVTransferConfig("x", transport="tcp")


def test_stats_delta_and_histogram_buckets():
    stats = KVTransferStats()
    before = stats.copy()
    stats.observe_seconds(0.0005)  # lands in the "le 0.0005" bucket
    stats.observe_seconds(7.0)  # +Inf
    stats.bytes_total += 10
    stats.in_flight = 2
    delta = stats.since(before)
    assert delta.bytes_total == 10 and delta.in_flight == 2 and delta.seconds_count == 2
    assert delta.seconds_bucket_counts[0] == 1 and delta.seconds_bucket_counts[-1] == 1
