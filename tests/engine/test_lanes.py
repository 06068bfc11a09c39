"""A bf16 model's matrices packed in the lanes layout after loading
(`engine/models/lanes.py`): which ones, lookups on a tied table, and the forward's
logits those of the row-major matrices within the bf16 dot products' rounding; a
recorded decode step on them is the eager one bit for bit (`test_cpu_decode.py`)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.engine.models.lanes import LanesMatrix, pack_matrices
from pdserve.engine.models.precision import store_matrices_narrow
from pdserve.engine.step_inputs import build_step_inputs, contiguous_block_tables
from pdserve.engine.synthetic_model import random_llama, small_llama_shape
from pdserve.kernels import dispatch

BS = 16


@pytest.fixture(autouse=True)
def dot_products():
    kernels = dispatch.cpu_kernels()
    if kernels is None or not kernels.bf16_dot:
        pytest.skip("packing needs the C kernels' bf16 dot products")


def bf16_model(**changes):
    cfg = small_llama_shape(max_position_embeddings=BS * 4, **changes)
    model = random_llama(cfg, torch.float32, "cpu", seed=1, std=0.3)
    with torch.inference_mode():
        store_matrices_narrow(model, torch.bfloat16)
    return model


@torch.inference_mode()
def logits(model) -> torch.Tensor:
    cfg = model.cfg
    shape = KVCacheShape(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BS, torch.float32
    )
    cache = KVCache(shape, 16, "cpu")
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (7, 40)]
    inputs = build_step_inputs([(s, 0) for s in seqs], contiguous_block_tables(2, 4), BS, None)
    hidden = model(inputs.token_ids, inputs.positions, cache.layers, inputs.meta)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("tied", [False, True])
def test_the_layers_and_the_head_are_packed_and_compute_the_same(tied):
    model = bf16_model(tie_word_embeddings=tied)
    before = logits(model)
    table = (model.embed if tied else model.lm_head).detach().clone()
    assert pack_matrices(model) == 4 * len(model.layers) + 1
    layer = model.layers[0]
    for matrix in (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight):
        assert isinstance(matrix, LanesMatrix)
    head = model.embed if tied else model.lm_head
    assert isinstance(head, LanesMatrix)
    assert isinstance(model.embed, LanesMatrix) == tied  # an untied table stays rows
    ids = torch.tensor([0, 5, 511, 5])
    if tied:
        looked_up = model.tp.embed(ids, model.embed, 512, torch.float32)
        assert torch.equal(looked_up, table[ids].float())
        with pytest.raises(IndexError, match="row ids"):
            model.embed.rows(torch.tensor([512]), torch.float32)
    with pytest.raises(ValueError, match="expects 64"):
        head(torch.zeros(2, 65))
    after = logits(model)
    # Both take bf16 dot products of the same values and only the order of the sums
    # differs, but a last-bit difference can round a next layer's input to another bf16.
    assert (after - before).abs().max() <= 0.01 * before.abs().max()
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_nothing_is_packed_with_dot_products_off():
    kernels = dispatch.cpu_kernels()
    model = bf16_model()
    kernels.bf16_dot = False
    try:
        assert pack_matrices(model) == 0
    finally:
        kernels.bf16_dot = True
    assert isinstance(model.layers[0].attn.qkv_weight, torch.Tensor)
