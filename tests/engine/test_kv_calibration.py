"""`calculate_kv_scales=True`: an FP8 cache's per-layer scales come from one prefill of
the calibration text at load, so that text's largest key and value take half the
format's range in the cache (exactly in the first layer; in later ones nearly, since
the calibration attends over a 16-bit cache and the engine over the FP8 one); asking for
it without an FP8 cache, or with pipeline stages, is one line."""

from __future__ import annotations

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.kv_calibration import CALIBRATION_TEXT, HEADROOM
from pdserve.text.tokenizer import Tokenizer


def test_the_calibration_texts_largest_entries_take_half_the_fp8_range():
    engine = EngineCore(
        kv_cache_dtype="fp8", calculate_kv_scales=True, num_threads=2,
        kv_cache_memory=32 << 20, max_model_len=1024, enable_prefix_caching=False,
    )  # fmt: skip
    kv = engine.info.kv
    assert len(kv.k_scales) == len(kv.v_scales) == kv.model_layers
    assert 1.0 not in kv.k_scales + kv.v_scales  # measured, not the default
    ids = Tokenizer.from_folder(engine.model_path).encode(CALIBRATION_TEXT)
    request = engine.make_request("r", ids, SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    storage = engine.executor.worker.kv_cache.storage  # only this prompt was written
    half_range = 448.0 / HEADROOM  # e4m3's largest value is 448
    largest = storage.float().abs().amax(dim=(0, 3, 4, 5))  # [layers, keys/values]
    assert largest[0].tolist() == [half_range, half_range]
    assert (largest >= 0.75 * half_range).all() and (largest <= 1.25 * half_range).all()


def test_it_needs_an_fp8_cache_and_a_whole_model():
    with pytest.raises(ValueError, match="needs kv_cache_dtype fp8, fp8_e4m3 or fp8_e5m2"):
        EngineConfig(calculate_kv_scales=True)
    with pytest.raises(ValueError, match="not built for pipeline stages"):
        EngineConfig(kv_cache_dtype="fp8", calculate_kv_scales=True, pipeline_parallel_size=2)


def test_tensor_parallel_ranks_agree_on_the_whole_models_scales():
    """Each TP rank sees its heads only; the group takes the largest over them, so the
    scales are the unsplit model's (within float32 summation order)."""
    args = dict(
        dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True, num_threads=2,
        num_kv_blocks=64, max_model_len=256,
    )  # fmt: skip
    whole = EngineCore(**args).info.kv
    split_engine = EngineCore(**args, tensor_parallel_size=3)
    try:
        split = split_engine.info.kv
    finally:
        split_engine.shutdown()
    for a, b in ((whole.k_scales, split.k_scales), (whole.v_scales, split.v_scales)):
        assert a == pytest.approx(b, rel=1e-4)
