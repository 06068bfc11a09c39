"""GGUF files served in their own blocks: the embedded model's Q4_1 file against its float32
conversion (greedy tokens, near-ties aside), the matrices packed with their scales, the
folder made from the file's metadata, the peak memory of loading, the tensor-parallel
slice rule on packed rows and blocks, and the one-line refusals."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine import embedded
from pdserve.engine.checkpoint import ModelConfig, load_model_config
from pdserve.engine.gguf_file import GGUFError, GGUFFile
from pdserve.engine.gguf_loader import load_gguf_weights, open_gguf
from pdserve.engine.gguf_prepare import check_tp_blocks, gguf_source, prepare_gguf
from pdserve.engine.loader import build_model
from pdserve.engine.models.lanes import LanesMatrix
from pdserve.engine.models.packed import PackedMatrix
from pdserve.engine.parallel import TensorParallel
from pdserve.kernels import lanes
from pdserve.text.tokenizer import Tokenizer
from tests.engine.gguf_files import INTER, write_tiny_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
MAX_TOKENS = 12
NEAR_TIE = 1e-3  # top-2 logits closer than this times max |logit|
_log = logging.getLogger(__name__)


def _llm(model: str | None):
    from pdserve import LLM

    return LLM(
        model=model, dtype="float32", num_threads=2, kv_cache_memory=32 << 20, max_model_len=512
    )


@pytest.fixture
def kernels_bf16_dot():
    from pdserve.kernels import cpu_ops

    if not cpu_ops.load().bf16_dot:
        pytest.skip("the C kernels take no bf16 dot products on this CPU")


def _worker(llm):
    return llm.engine.executor.worker


@pytest.fixture(scope="module")
def float32_llm():
    """The float32 conversion, named: on CPU the default is the GGUF file itself."""
    return _llm(str(embedded.embedded_model_path()))


@pytest.fixture(scope="module")
def gguf_llm():
    return _llm(str(embedded.gguf_path()))


def _greedy_with_logits(llm, prompt: str) -> tuple[list[int], list[torch.Tensor]]:
    """One prompt's greedy tokens and the logits row each was sampled from."""
    worker = _worker(llm)
    rows: list[torch.Tensor] = []
    take = worker.take_logits

    def recording(logits, batch):
        if batch.sampling_requests:
            rows.append(logits[0].float().clone())
        return take(logits, batch)

    worker.take_logits = recording
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    finally:
        del worker.take_logits
    return tokens, rows


def test_greedy_tokens_equal_float32s_but_at_near_ties(float32_llm, gguf_llm):
    for prompt in PROMPTS:
        full, logits = _greedy_with_logits(float32_llm, prompt)
        packed, _ = _greedy_with_logits(gguf_llm, prompt)
        pairs = enumerate(zip(full, packed, strict=True))
        diverge = next((i for i, (a, b) in pairs if a != b), None)
        if diverge is None:
            continue
        row = logits[diverge]
        top = row.topk(2).values
        gap, bound = float(top[0] - top[1]), NEAR_TIE * float(row.abs().max())
        _log.warning(
            "%r: token %d differs at a gap of %.3g (near-tie bound %.3g)",
            prompt,
            diverge,
            gap,
            bound,
        )
        assert packed[diverge] in row.topk(2).indices.tolist() and gap <= bound, (prompt, diverge)


def _row_major(llm) -> None:
    """A bf16 model's matrices back from the lanes layout to plain bf16 rows, which the
    row-major bf16 dot-product kernel reads (the one GGUF blocks decode into)."""
    model = _worker(llm).model
    owners = [(layer.attn, n) for layer in model.layers for n in ("qkv_weight", "o_weight")]
    owners += [(layer.mlp, n) for layer in model.layers for n in ("gate_up_weight", "down_weight")]
    owners += [(model, "embed"), (model, "lm_head")]
    for module, name in owners:
        matrix = getattr(module, name)
        if isinstance(matrix, LanesMatrix):
            plain = lanes.unpack(matrix.packed, matrix.n, matrix.k)
            delattr(module, name)
            setattr(module, name, torch.nn.Parameter(plain, requires_grad=False))


def test_served_in_bfloat16_its_logits_are_its_bf16_folders(kernels_bf16_dot):
    """In bfloat16 the packed layers decode to bf16 (bf16 dot products): the logits of the
    file (the default model on CPU) are, bit for bit, those of its float32 conversion
    served in bfloat16 on the same (row-major) kernel."""
    from pdserve import LLM

    def bf16(model: str | None):
        return LLM(
            model=model,
            dtype="bfloat16",
            num_threads=2,
            kv_cache_memory=32 << 20,
            max_model_len=512,
        )

    folder, packed = bf16(str(embedded.embedded_model_path())), bf16(None)
    _row_major(folder)
    formats = (folder.engine.info.weight_format, packed.engine.info.weight_format)
    assert formats == ("", "GGUF Q4_1/Q8_0")  # the layers' blocks, then the table's
    for prompt in PROMPTS[:2]:
        tokens, logits = _greedy_with_logits(folder, prompt)
        packed_tokens, packed_logits = _greedy_with_logits(packed, prompt)
        assert tokens == packed_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits, packed_logits, strict=True))


def test_the_matrices_stay_packed_and_the_table_is_the_serving_dtype(float32_llm, gguf_llm):
    model = _worker(gguf_llm).model
    for layer in model.layers:
        for matrix in (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
                       layer.mlp.down_weight):  # fmt: skip
            assert isinstance(matrix, PackedMatrix) and matrix.format_names() == ["Q4_1"]
            ((weight, _),) = matrix.segments()
            assert weight.dtype == torch.uint8
    floats = [p for p in model.parameters() if p.is_floating_point() and p.dim() == 2]
    assert floats == []  # no float copy of a matrix, nor of the table
    assert isinstance(model.embed, PackedMatrix) and model.embed.format_names() == ["Q8_0"]
    info = gguf_llm.engine.info
    assert info.weight_format == "GGUF Q4_1/Q8_0"
    # 30 layers of Q4_1 (0.625 bytes a weight) and the Q8_0 table (1.0625) of 49152 x 576.
    assert info.weight_bytes < 0.2 * float32_llm.engine.info.weight_bytes


def test_the_folder_carries_the_files_tokenizer_template_and_config(gguf_llm):
    folder = gguf_llm.engine.model_path
    assert gguf_source(folder) == embedded.gguf_path().resolve()
    converted = embedded.embedded_model_path()
    assert load_model_config(folder) == load_model_config(converted)
    ours, theirs = Tokenizer.from_folder(folder), Tokenizer.from_folder(str(converted))
    text = "Hello, world! 12345 <|im_start|>user\nçà"
    assert ours.encode(text) == theirs.encode(text)
    ours_config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    theirs_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert ours_config == theirs_config and ours_config["chat_template"]
    assert prepare_gguf(embedded.gguf_path()) == Path(folder)  # prepared once


def test_loading_a_q4_file_peaks_below_twice_its_size(tmp_path):
    """A fresh process: the resident high-water mark while the model loads (no KV cache
    here), with the malloc thresholds a CPU worker sets. bfloat16 (`auto` on this
    machine): below 2x the file. Either dtype: at most half the file above the model's
    own tensor bytes, so no transient copy of the table (1.15x the file in float32) or of
    the packed layers fits; the rest is allocator and library pages, which differ between
    machines."""
    code = (
        "import json, sys, torch\n"
        "from pdserve.engine import embedded\n"
        "from pdserve.engine.checkpoint import load_model_config\n"
        "from pdserve.engine.gguf_prepare import prepare_gguf\n"
        "from pdserve.engine.host_memory import keep_buffers_mapped\n"
        "from pdserve.engine.loader import load_model\n"
        "from pdserve.engine.worker import _peak_resident_bytes, _resident_bytes\n"
        "folder = prepare_gguf(embedded.gguf_path()); mc = load_model_config(folder)\n"
        "keep_buffers_mapped()  # as an engine's worker loads\n"
        "before = _resident_bytes()\n"
        "model = load_model(folder, mc, getattr(torch, sys.argv[1]))\n"
        "tensors = [*model.parameters(), *model.buffers()]\n"
        "own = sum(t.numel() * t.element_size() for t in tensors)\n"
        "print(json.dumps({'peak': _peak_resident_bytes() - before, 'own': own}))\n"
    )
    size = embedded.gguf_path().stat().st_size
    for dtype in ("bfloat16", "float32"):
        child = subprocess.run(
            [sys.executable, "-c", code, dtype], capture_output=True, text=True, timeout=300
        )
        assert child.returncode == 0, child.stderr[-2000:]
        got = json.loads(child.stdout.strip().splitlines()[-1])
        peak, own = got["peak"], got["own"]
        mib = [round(b / 2**20) for b in (peak, own, size)]
        _log.warning("loading as %s: peak, tensors, file (MiB): %s", dtype, mib)
        assert 0 < peak < own + size // 2, (dtype, peak, own, size)
        if dtype == "bfloat16":
            assert peak < 2 * size, (peak, size)


def load_gguf_model(path, config: ModelConfig, tp: TensorParallel | None = None):
    """The float32 CPU model (this rank's slice) over a bare GGUF file."""
    model = build_model(config, torch.float32, "cpu", tp)
    load_gguf_weights(open_gguf(path, "cpu", None), model, torch.float32)
    return model.eval()


def _tiny_config(path) -> ModelConfig:
    return ModelConfig.from_dict(embedded.hf_config(GGUFFile(path).metadata, tied=True), path)


def test_tp2_ranks_hold_the_packed_rows_and_whole_blocks_of_columns(tmp_path):
    """Column-parallel (QKV, gate/up): a rank's rows with their blocks. Row-parallel
    (output, down): a rank's columns, 32-weight blocks whole, the same bytes."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", GGMLQuantizationType.Q4_0)
    mc = _tiny_config(path)
    whole = load_gguf_model(path, mc)
    q, kv, inter = 32, 16, INTER // 2  # each rank's query rows, KV rows, MLP rows
    for r in range(2):
        rank = load_gguf_model(path, mc, TensorParallel(r, 2))
        layer, w0 = rank.layers[1], whole.layers[1]
        qkv_rows = torch.cat([torch.arange(r * q, (r + 1) * q),
                              64 + torch.arange(r * kv, (r + 1) * kv),
                              96 + torch.arange(r * kv, (r + 1) * kv)])  # fmt: skip
        packed = lambda m: m.segments()[0][0]  # noqa: E731
        assert torch.equal(packed(layer.attn.qkv_weight), packed(w0.attn.qkv_weight)[qkv_rows])
        gate_up_rows = torch.cat([torch.arange(r * inter, (r + 1) * inter),
                                  INTER + torch.arange(r * inter, (r + 1) * inter)])  # fmt: skip
        assert torch.equal(
            packed(layer.mlp.gate_up_weight), packed(w0.mlp.gate_up_weight)[gate_up_rows]
        )
        o_bytes = 18 * q // 32  # Q4_0: 18 bytes a block of 32
        assert torch.equal(
            packed(layer.attn.o_weight),
            packed(w0.attn.o_weight)[:, r * o_bytes : (r + 1) * o_bytes],
        )
        down_bytes = 18 * inter // 32
        assert torch.equal(
            packed(layer.mlp.down_weight),
            packed(w0.mlp.down_weight)[:, r * down_bytes : (r + 1) * down_bytes],
        )


def test_the_whole_tiny_model_computes_its_dequantized_weights(tmp_path):
    """Mixed types in one fused matrix (Q8_0 V beside Q4_1 Q/K) make two segments; the
    output equals the reference over the dequantized rows, in the Hugging Face order."""
    from gguf.quants import dequantize

    path = write_tiny_gguf(tmp_path / "mixed.gguf", GGMLQuantizationType.Q4_1,
                           {"attn_v.weight": GGMLQuantizationType.Q8_0})  # fmt: skip
    model = load_gguf_model(path, _tiny_config(path))
    qkv = model.layers[0].attn.qkv_weight
    assert qkv.format_names() == ["Q4_1", "Q8_0"]
    file = GGUFFile(path)
    from gguf import GGUFReader

    raw = {t.name: t for t in GGUFReader(path).tensors}
    v = dequantize(raw["blk.0.attn_v.weight"].data, GGMLQuantizationType.Q8_0)
    x = torch.randn(3, 64)
    y = qkv(x)
    torch.testing.assert_close(y[:, 96:], x @ torch.from_numpy(v).T, atol=1e-4, rtol=1e-4)
    assert file.type_names()[0] == "Q4_1"


def test_an_unserved_tensor_type_is_refused_in_one_line_naming_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "mxfp4.gguf", GGMLQuantizationType.Q4_0,
                           {"ffn_down.weight": GGMLQuantizationType.MXFP4})  # fmt: skip
    with pytest.raises(GGUFError) as refused:
        prepare_gguf(path, cache=tmp_path / "cache")
    message = str(refused.value)
    assert "\n" not in message
    assert "tensor 'blk.0.ffn_down.weight' is MXFP4, which pdserve does not serve" in message
    assert not any((tmp_path / "cache").rglob("config.json"))  # nothing half-written


def test_a_tp_split_inside_a_block_is_refused(tmp_path):
    """4 ranks of the output projection's 64 columns would split at 16, inside a block."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", GGMLQuantizationType.Q8_0)
    with pytest.raises(GGUFError, match="splits at columns 16:32, not on its 32-weight blocks"):
        GGUFFile(path).read_columns("model.layers.0.self_attn.o_proj.weight", 16, 32)
    aligned = GGUFFile(path).read_columns("model.layers.0.self_attn.o_proj.weight", 32, 64)
    assert aligned.shape == (64, 34)  # one Q8_0 block of each row


def test_the_tp_check_before_start_names_a_split_inside_a_block(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", GGMLQuantizationType.Q4_1)
    folder = prepare_gguf(path, cache=tmp_path / "cache")
    check_tp_blocks(folder, 2)  # 32 columns a rank: one block
    with pytest.raises(GGUFError, match=r"tensor_parallel_size 4 gives each rank 16 columns"):
        check_tp_blocks(folder, 4)
    check_tp_blocks(embedded.embedded_model_path(), 4)  # not a GGUF folder: nothing to check
