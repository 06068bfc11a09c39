from __future__ import annotations

import msgspec
import pytest
import torch

from pdserve.engine.kv_cache import KVCacheShape
from pdserve.kvtransfer.layout import (
    KVLayoutMismatch,
    Run,
    check_compatible,
    check_tp_split,
    coalesce,
    head_range,
    layout_of,
    source_slices,
)
from pdserve.kvtransfer.messages import KVLayout, KVSource

LAYOUT = KVLayout(block_size=16, num_layers=4, num_kv_heads=8, head_dim=64, dtype="bfloat16")


def test_coalesce_groups_runs_consecutive_on_both_sides():
    runs = coalesce([4, 5, 6, 9, 10, 3], [0, 1, 2, 3, 7, 8])
    assert runs == [Run(4, 0, 3), Run(9, 3, 1), Run(10, 7, 1), Run(3, 8, 1)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match="2 source blocks for 1 destination"):
        coalesce([1, 2], [1])


def test_layout_of_engine_shape_counts_heads_of_all_ranks():
    shape = KVCacheShape(30, 3, 64, 16, torch.bfloat16)
    layout = layout_of(shape)
    assert layout == KVLayout(16, 30, 3, 64, "bfloat16")
    assert layout.bytes_per_block == shape.bytes_per_block
    assert layout_of(KVCacheShape(4, 2, 8, 16, torch.float32), tp_size=4).num_kv_heads == 8


def test_compatibility_names_every_difference():
    other = KVLayout(block_size=32, num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16")
    with pytest.raises(KVLayoutMismatch) as info:
        check_compatible(LAYOUT, other, "prefill instance p0")
    message = str(info.value)
    assert "prefill instance p0" in message and "\n" not in message
    assert "block_size 32 there vs 16 here" in message
    assert "head_dim 128 there vs 64 here" in message
    assert "dtype float16 there vs bfloat16 here" in message
    check_compatible(LAYOUT, LAYOUT, "itself")


def test_an_fp8_layout_carries_its_scales_and_a_mismatch_is_one_line():
    from pdserve.engine.step_plan import KVGeometry

    scales = [1.0, 2.0, 1.0, 1.0]
    geometry = KVGeometry(4, 8, 64, 16, "float8_e4m3fn", 10, k_scales=scales, v_scales=[1.0] * 4)
    fp8 = layout_of(geometry)
    assert (fp8.dtype, fp8.k_scales, fp8.v_scales) == ("float8_e4m3fn", scales, [1.0] * 4)
    assert fp8.bytes_per_block * 2 == LAYOUT.bytes_per_block  # half of bfloat16's
    assert geometry.bytes_per_token(2) == 2 * 4 * 16 * 64  # two ranks of 8 heads, 1 byte each
    with pytest.raises(KVLayoutMismatch) as info:  # prefill fp8, decode auto
        check_compatible(LAYOUT, fp8, "prefill instance p0")
    assert str(info.value) == (
        "KV layout mismatch with prefill instance p0: dtype float8_e4m3fn there vs bfloat16 "
        "here (--kv-cache-dtype must be the same on both)"
    )
    rescaled = KVLayout(**{**msgspec.structs.asdict(fp8), "k_scales": [1.0] * 4})
    with pytest.raises(KVLayoutMismatch, match="k_scales differ .an FP8 KV cache's scales"):
        check_compatible(fp8, rescaled, "prefill instance p0")
    check_compatible(fp8, layout_of(geometry), "itself")


def test_tp_split_must_divide_heads():
    check_tp_split(LAYOUT, 8, "x")
    with pytest.raises(KVLayoutMismatch, match="size 3 does not divide the model's 8 KV heads"):
        check_tp_split(LAYOUT, 3, "x")


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 8), (8, 8)])
def test_source_slices_cover_each_decode_rank_exactly(src_tp, dst_tp):
    for dst_rank in range(dst_tp):
        lo, hi = head_range(LAYOUT, dst_rank, dst_tp)
        slices = source_slices(LAYOUT, dst_rank, dst_tp, src_tp)
        covered = [h for s in slices for h in range(s.start, s.end)]
        assert covered == list(range(lo, hi))
        for piece in slices:
            s_lo, s_hi = head_range(LAYOUT, piece.src_rank, src_tp)
            assert s_lo <= piece.start < piece.end <= s_hi


def test_pipeline_stages_must_match_and_address_the_same_stage():
    """Both pools use the same PP size: a stage's layers move to the same stage, so a
    different size is refused in one line, and a stage's source ranks are its own."""
    staged = KVLayout(16, 4, 8, 64, "bfloat16", pipeline_parallel_size=2)
    with pytest.raises(KVLayoutMismatch) as info:
        check_compatible(LAYOUT, staged, "prefill instance p0")
    message = str(info.value)
    assert "pipeline_parallel_size 2 there vs 1 here" in message and "\n" not in message
    source = KVSource("p0", ["s0r0", "s0r1", "s1r0", "s1r1"], [0], staged)
    assert source.tp_size == 2
    assert [source.address_of(1, r) for r in range(2)] == ["s1r0", "s1r1"]


def test_layout_of_a_pipeline_stage_names_the_whole_model():
    from pdserve.engine.step_plan import KVGeometry

    stage = KVGeometry(2, 3, 64, 16, "float32", 10, first_layer=2, model_layers=4,
                       pipeline_stage=1, pipeline_parallel_size=2)  # fmt: skip
    assert layout_of(stage, tp_size=1) == KVLayout(16, 4, 3, 64, "float32", 2)
