"""Decode steps recorded as one C call (`engine/cpu_decode.py`) against the eager
forward: the same logits and the same KV-cache writes, bit for bit, at every recorded
batch size; the steps a program cannot hold run eagerly."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.cpu_decode import CpuDecodeSteps, unrecordable_reason
from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.engine.models.lanes import LanesMatrix, pack_matrices
from pdserve.engine.models.packed import PLAIN, PackedMatrix
from pdserve.engine.models.precision import store_matrices_narrow
from pdserve.engine.step_inputs import build_step_inputs, contiguous_block_tables
from pdserve.engine.synthetic_model import checkpoint_tensors, random_llama, small_llama_shape
from pdserve.kernels import dispatch

BS = 16
BLOCKS_PER_SEQ = 8
CFG = small_llama_shape(max_position_embeddings=BS * BLOCKS_PER_SEQ)


@pytest.fixture(autouse=True)
def c_kernels():
    if dispatch.cpu_kernels() is None:
        pytest.skip(f"no C kernels here: {dispatch.cpu_kernels_status()}")


def kv_cache() -> KVCache:
    shape = KVCacheShape(
        CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, BS, torch.float32
    )
    return KVCache(shape, 64, "cpu")


@torch.inference_mode()
def eager(model, cache: KVCache, inputs) -> torch.Tensor:
    hidden = model(inputs.token_ids, inputs.positions, cache.layers, inputs.meta)
    return model.compute_logits(hidden[inputs.logits_indices])


def steps_for(model, cache: KVCache, max_size: int = 4) -> CpuDecodeSteps:
    return CpuDecodeSteps(model, cache.layers, max_size, BLOCKS_PER_SEQ, BS)


def prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def decode_side_by_side(model, lengths: list[int], rounds: list[list[int]]):
    """Prefills `lengths` into two caches, then decodes the sequences each round names
    (greedy, one token each) eagerly in one cache and through the programs in the other;
    yields both logits and both caches after every round."""
    plain, recorded = kv_cache(), kv_cache()
    steps = steps_for(model, recorded)
    tables = contiguous_block_tables(len(lengths), BLOCKS_PER_SEQ)
    seqs = prompts(lengths)
    window = model.sliding_window
    prefill = build_step_inputs([(p, 0) for p in seqs], tables, BS, window)
    first = eager(model, plain, prefill).argmax(-1).tolist()
    eager(model, recorded, prefill)
    for s, token in zip(seqs, first, strict=True):
        s.append(token)
    for rows in rounds:
        step = build_step_inputs(
            [([seqs[i][-1]], len(seqs[i]) - 1) for i in rows], tables[rows], BS, window
        )
        assert steps.can_run(step.meta)
        with torch.inference_mode():
            got = steps.run(step.token_ids, step.positions, step.meta, step.logits_indices)
        want = eager(model, plain, step)
        yield got, want, plain, recorded
        for i, token in zip(rows, want.argmax(-1).tolist(), strict=True):
            seqs[i].append(token)


def test_every_batch_size_gives_the_eager_logits_and_cache_bit_for_bit():
    model = random_llama(CFG, torch.float32, "cpu", seed=0, std=0.3)
    rounds = [[0, 1, 2], [0], [2, 0], [1, 2, 0, 3], [3], [0, 1, 2, 3]] * 2
    for got, want, plain, recorded in decode_side_by_side(model, [5, 17, 33, 2], rounds):
        assert got is not None and got.shape == want.shape
        assert torch.equal(got, want)
        assert torch.equal(plain.storage, recorded.storage)


def test_int8_matrices_and_a_sliding_window_record_too():
    cfg = small_llama_shape(max_position_embeddings=BS * BLOCKS_PER_SEQ, sliding_window=20)
    source = random_llama(cfg, torch.float32, "cpu", seed=2, std=0.3)
    model = random_llama(cfg, torch.float32, "cpu")
    with torch.inference_mode():  # the synthetic model's tensors are inference tensors
        model.quantize_int8()
        model.load_weights(checkpoint_tensors(source))
    for got, want, plain, recorded in decode_side_by_side(model, [30, 3], [[0, 1]] * 6):
        assert torch.equal(got, want)
        assert torch.equal(plain.storage, recorded.storage)


def test_bf16_matrices_in_the_lanes_layout_record_too():
    model = random_llama(CFG, torch.float32, "cpu", seed=4, std=0.3)
    with torch.inference_mode():
        store_matrices_narrow(model, torch.bfloat16)
    if not pack_matrices(model):
        pytest.skip("no bf16 dot products here: nothing is packed")
    assert isinstance(model.layers[0].attn.qkv_weight, LanesMatrix)
    for got, want, plain, recorded in decode_side_by_side(model, [9, 40], [[0, 1], [1]] * 3):
        assert torch.equal(got, want)
        assert torch.equal(plain.storage, recorded.storage)


def test_batches_a_program_does_not_hold_are_left_to_the_eager_forward():
    model = random_llama(CFG, torch.float32, "cpu", seed=0)
    steps = steps_for(model, kv_cache(), max_size=2)
    tables = contiguous_block_tables(3, BLOCKS_PER_SEQ)
    three = build_step_inputs([([1], 4), ([2], 9), ([3], 1)], tables, BS)
    mixed = build_step_inputs([([1], 4), ([2, 3, 4], 0)], tables[:2], BS)
    one = build_step_inputs([([1], 4)], tables[:1], BS)
    assert not steps.can_run(three.meta)  # over max_size
    assert not steps.can_run(mixed.meta)  # a prompt chunk
    assert steps.can_run(one.meta)
    dispatch.set_cpu_kernels_enabled(False)
    try:
        assert not steps.can_run(one.meta)  # the references would run: no program
    finally:
        dispatch.set_cpu_kernels_enabled(True)


def test_models_a_program_cannot_hold_say_why():
    assert unrecordable_reason(random_llama(CFG, torch.float32, "cpu")) is None
    qk = small_llama_shape(max_position_embeddings=BS * BLOCKS_PER_SEQ, qk_norm=True)
    model = random_llama(qk, torch.float32, "cpu")
    assert unrecordable_reason(model) == "q/k norms"
    assert CpuDecodeSteps.for_model(model, kv_cache().layers, 8, 128, BS) is None


def test_a_step_that_cannot_be_recorded_runs_eagerly_from_then_on():
    model = random_llama(CFG, torch.float32, "cpu", seed=0)
    attn = model.layers[0].attn
    weight = attn.qkv_weight.data
    del attn.qkv_weight  # as the GGUF loader swaps a float parameter for its segments
    attn.qkv_weight = PackedMatrix([(weight, PLAIN)])
    attn.qkv_bias = torch.zeros(attn.qkv_weight.segments()[0][0].shape[0])
    steps = steps_for(model, kv_cache())
    step = build_step_inputs([([1], 4)], contiguous_block_tables(1, BLOCKS_PER_SEQ), BS)
    assert steps.run(step.token_ids, step.positions, step.meta, step.logits_indices) is None
    assert steps.disabled_reason == "a GGUF matrix in several segments or with a bias"
    assert not steps.can_run(step.meta)
