"""GGUF files of K-quants served in their own super-blocks: a tiny llama whose tensors mix
Q4_K, Q5_K, Q6_K and Q8_0 (as a Q4_K_M file does) gives the greedy tokens of the same model
written in float32, its matrices stay packed, its reported weight bytes and format are the
file's, and the tensor-parallel slice rule holds whole 256-weight super-blocks. So does a
file whose rows are not whole super-blocks, kept in the 32-weight types Q5_0 and Q5_1 (as
SmolLM2's Q4_K_M and Q5_K_M files keep their 576-column matrices) beside K-quants."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.gguf_file import GGUFError, GGUFFile
from pdserve.engine.gguf_prepare import check_tp_blocks, prepare_gguf
from pdserve.engine.models.packed import PackedMatrix
from pdserve.engine.parallel import TensorParallel
from tests.engine.gguf_files import write_tiny_gguf
from tests.engine.test_gguf import _tiny_config, load_gguf_model

if TYPE_CHECKING:
    from pdserve import LLM

HIDDEN, INTER = 256, 512  # K-quant rows are whole super-blocks of 256
# A Q4_K_M-like mix: Q4_K mostly, Q6_K for V, the down projection and the embedding.
MIX = {
    "attn_v.weight": Q.Q6_K,
    "attn_output.weight": Q.Q5_K,
    "ffn_down.weight": Q.Q6_K,
    "token_embd.weight": Q.Q6_K,
}
# Rows of 128 columns are not whole super-blocks: llama.cpp's fallbacks hold them, Q5_0
# (for Q4_K) and Q5_1 (for Q5_K); the down projection's 512 columns stay K-quants, Q6_K in
# one layer and Q4_K in the other, as a Q4_K_M file varies them.
Q5_HIDDEN, Q5_INTER = 128, 512
Q5_MIX = {
    "attn_v.weight": Q.Q5_1,
    "ffn_down.weight": Q.Q6_K,
    "blk.1.ffn_down.weight": Q.Q4_K,
}
PROMPTS = [[5, 17, 40, 3, 88], [60, 61, 62], [94, 95, 12, 30, 31, 7, 2, 9]]


def _write(path: Path, types: dict[str, Q], dequantized: bool = False) -> Path:
    return write_tiny_gguf(path, Q.Q4_K, types, HIDDEN, INTER, dequantized)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("kquant")
    kquant = _write(folder / "tiny.Q4_K_M.gguf", MIX)
    plain = _write(folder / "tiny.F32.gguf", MIX, dequantized=True)
    q5 = write_tiny_gguf(folder / "tiny.Q5_0.gguf", Q.Q5_0, Q5_MIX, Q5_HIDDEN, Q5_INTER)
    q5_plain = write_tiny_gguf(
        folder / "tiny.Q5_0.F32.gguf", Q.Q5_0, Q5_MIX, Q5_HIDDEN, Q5_INTER, dequantized=True
    )
    cache = folder / "cache"
    return {
        "kquant": kquant,
        "kquant_folder": prepare_gguf(kquant, cache=cache),
        "plain_folder": prepare_gguf(plain, cache=cache),
        "q5": q5,
        "q5_folder": prepare_gguf(q5, cache=cache),
        "q5_plain_folder": prepare_gguf(q5_plain, cache=cache),
    }


@pytest.fixture(scope="module")
def llm(files) -> Callable[[str], LLM]:
    """The LLM of a prepared file ("kquant", "plain", "q5" or "q5_plain"), built on its
    first use and kept for the module."""
    from pdserve import LLM

    @functools.cache
    def built(name: str) -> LLM:
        return LLM(
            model=str(files[f"{name}_folder"]), dtype="float32", num_threads=2,
            kv_cache_memory=8 << 20, max_model_len=128,
        )  # fmt: skip

    return built


def _greedy(lm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [list(out.outputs[0].token_ids) for out in lm.generate(prompts, params)]


def test_greedy_tokens_are_those_of_the_same_model_in_float32(llm):
    """The packed kernels compute the float32 path's numbers of the dequantized weights,
    so the tokens are equal, near-ties included."""
    packed, plain = _greedy(llm("kquant")), _greedy(llm("plain"))
    assert packed == plain
    assert len({t for tokens in packed for t in tokens}) > 3  # not one repeated token


def test_q5_rows_beside_k_quants_give_the_tokens_of_the_same_model_in_float32(llm):
    q5_llm = llm("q5")
    packed, plain = _greedy(q5_llm), _greedy(llm("q5_plain"))
    assert packed == plain
    assert len({t for tokens in packed for t in tokens}) > 3
    model = q5_llm.engine.executor.worker.model
    downs = [["Q6_K"], ["Q4_K"]]
    for layer, down in zip(model.layers, downs, strict=True):
        formats = [m.format_names() for m in (layer.attn.qkv_weight, layer.attn.o_weight,
                   layer.mlp.gate_up_weight, layer.mlp.down_weight)]  # fmt: skip
        assert formats == [["Q5_0", "Q5_1"], ["Q5_0"], ["Q5_0"], down]
    formats = set(q5_llm.engine.info.weight_format.removeprefix("GGUF ").split("/"))
    assert formats == {"Q5_0", "Q5_1", "Q4_K", "Q6_K", "Q8_0"}  # Q8_0: the embedding table


def test_q5_weight_bytes_and_tp2_slices_are_whole_32_weight_blocks(files, llm):
    """The reported bytes are the file's blocks; 2 ranks of the Q5_0 output projection's
    128 columns: 64 a rank, two 22-byte blocks of each row; 16 columns are refused."""
    file = GGUFFile(files["q5"])
    packed = sum(t.nbytes for name, t in file.tensors.items() if name.startswith("model.layers.")
                 and len(t.shape) == 2)  # fmt: skip
    vectors = sum(t.shape[0] for t in file.tensors.values() if len(t.shape) == 1)
    table = file.tensors["model.embed_tokens.weight"]
    assert table.type_name == "Q8_0"  # kept in its blocks too
    assert llm("q5").engine.info.weight_bytes == packed + table.nbytes + 4 * vectors
    check_tp_blocks(files["q5_folder"], 2)
    config = _tiny_config(files["q5"])
    whole = load_gguf_model(files["q5"], config).layers[1].attn.o_weight.segments()
    for r in range(2):
        rank = load_gguf_model(files["q5"], config, TensorParallel(r, 2))
        ((o, qtype),) = rank.layers[1].attn.o_weight.segments()
        assert qtype == Q.Q5_0 and torch.equal(o, whole[0][0][:, r * 44 : (r + 1) * 44])
    with pytest.raises(GGUFError, match="splits at columns 16:32, not on its 32-weight blocks"):
        file.read_columns("model.layers.0.self_attn.o_proj.weight", 16, 32)


def test_the_matrices_stay_packed_and_the_weight_bytes_are_the_files(files, llm):
    kquant_llm = llm("kquant")
    model = kquant_llm.engine.executor.worker.model
    for layer in model.layers:
        formats = [m.format_names() for m in (layer.attn.qkv_weight, layer.attn.o_weight,
                   layer.mlp.gate_up_weight, layer.mlp.down_weight)]  # fmt: skip
        assert formats == [["Q4_K", "Q6_K"], ["Q5_K"], ["Q4_K"], ["Q6_K"]]
        matrices = (layer.attn.qkv_weight, layer.mlp.down_weight)
        assert all(isinstance(m, PackedMatrix) for m in matrices)
        assert all(w.dtype == torch.uint8 for m in matrices for w, _ in m.segments())
    info = kquant_llm.engine.info
    formats = set(info.weight_format.removeprefix("GGUF ").split("/"))
    assert formats == {"Q4_K", "Q5_K", "Q6_K"}  # the table's Q6_K among them
    file = GGUFFile(files["kquant"])
    packed = sum(t.nbytes for name, t in file.tensors.items() if name.startswith("model.layers.")
                 and len(t.shape) == 2)  # fmt: skip
    vectors = sum(t.shape[0] for t in file.tensors.values() if len(t.shape) == 1)
    # The layers' and the table's blocks as the file holds them, the norms in float32.
    table = file.tensors["model.embed_tokens.weight"]
    assert table.type_name == "Q6_K"
    assert info.weight_bytes == packed + table.nbytes + 4 * vectors


def test_tp2_ranks_hold_packed_rows_and_whole_super_blocks(tmp_path):
    """Column-parallel (QKV, gate/up): a rank's rows with their super-blocks. Row-parallel
    down (512 columns): 256 a rank, one Q6_K super-block of each row, the same bytes."""
    path = _write(tmp_path / "tp.gguf", {**MIX, "attn_output.weight": Q.Q8_0})
    check_tp_blocks(prepare_gguf(path, cache=tmp_path / "cache"), 2)
    config = _tiny_config(path)
    whole = load_gguf_model(path, config)
    for r in range(2):
        rank = load_gguf_model(path, config, TensorParallel(r, 2))
        ((down, qtype),) = rank.layers[1].mlp.down_weight.segments()
        assert qtype == Q.Q6_K
        ((whole_down, _),) = whole.layers[1].mlp.down_weight.segments()
        assert torch.equal(down, whole_down[:, r * 210 : (r + 1) * 210])
        gate_up = rank.layers[1].mlp.gate_up_weight.segments()[0][0]
        mine = torch.arange(r * 256, (r + 1) * 256)
        rows = torch.cat([mine, INTER + mine])
        assert torch.equal(gate_up, whole.layers[1].mlp.gate_up_weight.segments()[0][0][rows])


def test_a_tp_split_inside_a_super_block_is_refused_naming_the_tensor_and_size(files, tmp_path):
    """2 ranks of the Q5_K output projection's 256 columns: 128 each, half a super-block."""
    with pytest.raises(GGUFError) as refused:
        check_tp_blocks(files["kquant_folder"], 2)
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "tensor_parallel_size 2 gives each rank 128 columns of 'blk.0.attn_output.weight' "
        "(Q5_K), not whole 256-weight blocks" in message
    )
    with pytest.raises(GGUFError, match="splits at columns 0:128, not on its 256-weight blocks"):
        GGUFFile(files["kquant"]).read_columns("model.layers.0.self_attn.o_proj.weight", 0, 128)
