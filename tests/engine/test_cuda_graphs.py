"""Decode steps through static, padded buffers (the CUDA-graph path) and the device
executor. On CPU the graphs run uncaptured (`capture=False`), which exercises the
padding, the static buffers and the path choice; the capture itself needs CUDA."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import save_file

from pdserve.common.request import Request
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.cuda_graphs import DecodeInputBuffers, capture_sizes, graph_blockers
from pdserve.engine.device_inputs import HostToDeviceStager
from pdserve.engine.device_runner import DeviceRunner
from pdserve.engine.gpu_memory import FREE_MEMORY_MARGIN, GiB, MemoryProfile, kv_cache_bytes
from pdserve.engine.kv_cache import KVCache, KVCacheShape
from pdserve.engine.sampler import Sampler
from pdserve.engine.step_inputs import build_step_inputs, contiguous_block_tables
from pdserve.engine.synthetic_model import random_llama, small_llama_shape
from tests.engine.greedy import greedy_tokens

BS = 16
BLOCKS_PER_SEQ = 8  # max_model_len 128
CFG = small_llama_shape(max_position_embeddings=BS * BLOCKS_PER_SEQ)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (capture, device memory, device sampling)",
)


def tiny_model(device: str = "cpu"):
    return random_llama(CFG, torch.float32, device, seed=0, std=0.3)


def kv_cache(num_blocks: int, device: str = "cpu") -> KVCache:
    shape = KVCacheShape(
        CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, BS, torch.float32
    )
    return KVCache(shape, num_blocks, device)


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def slot_rows(cache: KVCache) -> torch.Tensor:
    """[num_blocks * block_size, everything else]: one row per token slot."""
    storage = cache.storage  # [blocks, layers, 2, kv heads, block_size, head_dim]
    return storage.permute(0, 4, 1, 2, 3, 5).reshape(cache.num_blocks * BS, -1)


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """Equal up to fp32 GEMM rounding: BLAS kernels depend on the row count, so a
    padded batch's real rows differ from the unpadded batch's in the last bits (a
    wrong row, slot or context would differ by whole units)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5, msg=msg)
    assert torch.equal(got.argmax(-1), want.argmax(-1)), msg


@torch.inference_mode()
def run_plain(model, cache: KVCache, inputs) -> torch.Tensor:
    hidden = model(inputs.token_ids, inputs.positions, cache.layers, inputs.meta)
    return model.compute_logits(hidden[inputs.logits_indices])


# ---- pure helpers -------------------------------------------------------------------


def test_capture_sizes_default_requested_and_capped():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    full = capture_sizes(1024)
    assert full[:5] == [1, 2, 4, 8, 16] and full[-1] == 512 and 256 in full and 272 in full
    assert 264 not in full  # every 16 past 256
    assert capture_sizes(64, [64, 1, 16, 16, 200]) == [1, 16, 64]


def test_graph_blockers_name_reference_kernels_on_cpu():
    # With the CPU C kernels off, CPU tensors run the torch references, which
    # synchronise with the host; the blockers name exactly those kernels.
    from pdserve.kernels import dispatch

    dispatch.set_cpu_kernels_enabled(False)
    try:
        assert graph_blockers(torch.device("cpu")) == [
            "write_kv_cache",
            "decode_attention",
            "rms_norm",
            "rotary_embedding",
            "rotary_write_kv_cache",
        ]
    finally:
        dispatch.set_cpu_kernels_enabled(True)


def test_kv_cache_bytes_follows_budget_and_free_memory():
    profile = MemoryProfile(
        total=100 * GiB, free=80 * GiB, weights=16 * GiB, activation_peak=2 * GiB, non_torch=GiB
    )
    assert kv_cache_bytes(profile, 0.9) == 90 * GiB - 19 * GiB
    # Other processes hold memory: bounded by what is free, less a margin.
    busy = MemoryProfile(**{**profile.__dict__, "free": 30 * GiB})
    assert kv_cache_bytes(busy, 0.9) == 30 * GiB - FREE_MEMORY_MARGIN
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        kv_cache_bytes(profile, 0.15)


def test_engine_config_checks_device_settings():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=[0, 8])
    assert EngineConfig(device="cuda:1", enforce_eager=True).device == "cuda:1"


def test_step_inputs_layout_and_errors():
    tables = contiguous_block_tables(3, 4, first_block=10)
    inputs = build_step_inputs([([7], 20), ([8], 3), ([1, 2, 3], 0)], tables, BS)
    assert inputs.meta.num_decode_seqs == 2
    assert inputs.positions.tolist() == [20, 3, 0, 1, 2]
    # Sequence 0 owns blocks 10..13: position 20 sits in block 11 at offset 4.
    assert inputs.meta.slot_mapping.tolist() == [11 * BS + 4, 14 * BS + 3] + [
        18 * BS + i for i in range(3)
    ]
    assert inputs.meta.context_lens.tolist() == [21, 4, 3]
    assert inputs.meta.block_tables.shape == (3, 2)  # trimmed to the longest context
    assert inputs.logits_indices.tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="must come before"):
        build_step_inputs([([1, 2], 0), ([3], 5)], tables, BS)
    with pytest.raises(ValueError, match="cannot hold"):
        build_step_inputs([([1], 4 * BS)], tables, BS)


def test_stager_packs_dtypes_into_views_that_equal_the_inputs():
    stager = HostToDeviceStager("cpu")
    first = [
        torch.arange(5),
        torch.arange(6, dtype=torch.int32).view(2, 3),
        torch.tensor([-1, 7]),
        torch.zeros(0, dtype=torch.int32),
    ]
    staged = stager.stage(first)
    for got, want in zip(staged, first, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    bigger = [torch.arange(3000), torch.arange(5000, dtype=torch.int32).view(50, 100)]
    for got, want in zip(stager.stage(bigger), bigger, strict=True):
        assert torch.equal(got, want)


# ---- padding and static buffers -----------------------------------------------------


def test_padded_decode_rows_equal_the_unpadded_batch_and_padding_writes_nothing():
    model = tiny_model()
    plain, padded = kv_cache(32), kv_cache(32)
    tables = contiguous_block_tables(3, BLOCKS_PER_SEQ)  # sequence 0 owns block 0
    prompts = random_prompts([5, 17, 33])
    prefill = build_step_inputs([(p, 0) for p in prompts], tables, BS)
    first = run_plain(model, plain, prefill).argmax(-1).tolist()
    run_plain(model, padded, prefill)
    step = build_step_inputs(
        [([t], len(p)) for t, p in zip(first, prompts, strict=True)], tables, BS
    )
    want = run_plain(model, plain, step)

    before = slot_rows(padded).clone()
    buffers = DecodeInputBuffers(8, BLOCKS_PER_SEQ, BS, torch.device("cpu"))
    for name, buffer in buffers.buffers.items():  # an earlier, larger batch's leftovers
        if name != "query_start_loc":
            buffer.fill_(5)
    buffers.stage(step.token_ids, step.positions, step.meta, step.logits_indices, size=8)
    token_ids, positions, meta = buffers.views(8)
    assert meta.block_tables.shape == (8, BLOCKS_PER_SEQ) and meta.num_decode_seqs == 8
    assert meta.slot_mapping[3:].tolist() == [-1] * 5
    assert meta.context_lens[3:].tolist() == [0] * 5 and token_ids[3:].tolist() == [0] * 5
    with torch.inference_mode():
        got = model.compute_logits(model(token_ids, positions, padded.layers, meta))
    assert_same_logits(got[:3], want)
    # Only the real rows' slots changed: slot -1 rows wrote nothing (block 0 is
    # sequence 0's, so a padding row writing slot 0 would show).
    changed = (slot_rows(padded) != before).any(dim=1).nonzero().flatten()
    assert changed.tolist() == sorted(step.meta.slot_mapping.tolist())
    torch.testing.assert_close(slot_rows(padded), slot_rows(plain), rtol=1e-5, atol=5e-5)


@dataclass
class SeqState:
    tokens: list[int]
    computed: int = 0
    outputs: list[int] = field(default_factory=list)


def drive(schedule, prompts, engines, graphs=None):
    """Runs `schedule` (per step: (sequence, new tokens) pairs) through each engine
    (a callable step -> logits), feeding every engine the first engine's greedy tokens.
    Returns the per-step logits of every engine and the paths the graphs would take."""
    seqs = [SeqState(list(p)) for p in prompts]
    tables = contiguous_block_tables(len(seqs), BLOCKS_PER_SEQ)
    logits_per_engine = [[] for _ in engines]
    paths = []
    for step in schedule:
        ordered = sorted(step, key=lambda item: item[1] != 1)
        chunks, rows = [], []
        for index, n in ordered:
            s = seqs[index]
            chunks.append((s.tokens[s.computed : s.computed + n], s.computed))
            rows.append(index)
        inputs = build_step_inputs(chunks, tables[rows], BS)
        if graphs is not None:
            paths.append(graphs.can_run(inputs.meta))
        outs = [engine(inputs) for engine in engines]
        for store, out in zip(logits_per_engine, outs, strict=True):
            store.append(out.cpu())
        for row, (index, n) in enumerate(ordered):
            s = seqs[index]
            s.computed += n
            if s.computed == len(s.tokens):  # the chunk reached the end: it samples
                token = int(outs[0][row].argmax())
                s.tokens.append(token)
                s.outputs.append(token)
    return logits_per_engine, paths, seqs


SCHEDULE = [
    [(0, 5), (1, 17), (2, 33), (3, 70), (4, 9)],  # prefill (eager)
    [(0, 1), (1, 1), (2, 1)],  # 3 decodes padded to 4
    [(3, 1), (4, 1), (0, 1), (1, 1), (2, 1)],  # 5 > largest size 4: eager fallback
    [(4, 1), (3, 1)],  # exactly 2; rows now hold other sequences (stale tables)
    [(2, 1), (5, 6)],  # decode beside a prefill chunk: eager
    [(5, 5), (1, 1)],  # the rest of that prompt beside a decode
    [(5, 1)],  # size 1, a short table after wide ones
    [(3, 1), (5, 1), (0, 1)],
]
SCHEDULE_PROMPTS = [5, 17, 33, 70, 9, 11]


def test_executor_paths_match_the_plain_model_step_for_step():
    model = tiny_model()
    plain = kv_cache(64)
    executor = DeviceRunner(model, kv_cache(64), BS * BLOCKS_PER_SEQ, [1, 2, 4], capture=False)
    executor.prepare()
    (want, got), paths, seqs = drive(
        SCHEDULE,
        random_prompts(SCHEDULE_PROMPTS),
        [lambda s: run_plain(model, plain, s), executor.execute],
        executor.graphs,
    )
    assert paths == [False, True, False, True, False, False, True, True]
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        assert_same_logits(g, w, f"step {step}")
    assert all(len(s.outputs) >= 2 for s in seqs)
    torch.testing.assert_close(executor.kv_cache.storage, plain.storage, rtol=1e-5, atol=5e-5)


def _write_checkpoint(folder) -> str:
    model = tiny_model()
    tensors = {}
    for name, shape in model.expected_weights():
        param, offset = model.target_of(name)
        tensors[name] = param[offset : offset + shape[0]].clone()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_theta": CFG.rope_theta,
        "rms_norm_eps": CFG.rms_norm_eps,
        "tie_word_embeddings": False,
        **{
            k: getattr(CFG, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "max_position_embeddings",
            )
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _generate(engine: EngineCore, prompts: list[list[int]]) -> dict[str, list[int]]:
    return greedy_tokens(engine, prompts, max_tokens=6, max_steps=200)


def test_engine_runner_hook_gives_the_tokens_of_the_plain_engine(tmp_path):
    folder = _write_checkpoint(tmp_path / "tiny")
    args = dict(
        model=folder, num_kv_blocks=48, max_num_seqs=5, max_num_batched_tokens=24, num_threads=1
    )
    prompts = random_prompts([3, 30, 12, 50, 7, 21], seed=5)
    want = _generate(EngineCore(**args), prompts)
    hooked = EngineCore(**args)
    worker = hooked.executor.worker  # the in-process rank behind the executor seam
    executor = DeviceRunner(
        worker.model, worker.kv_cache, hooked.max_model_len, [1, 2, 4], capture=False
    )
    executor.prepare()
    worker.runner.device_runner = executor
    seen = []
    run = executor.execute
    executor.execute = lambda step: (seen.append(executor.graphs.can_run(step.meta)), run(step))[1]
    assert _generate(hooked, prompts) == want
    assert all(len(t) == 6 for t in want.values())
    assert True in seen and False in seen  # both graph-shaped and eager steps ran


# ---- on a CUDA device ---------------------------------------------------------------


@needs_cuda
def test_captured_graphs_replay_the_eager_steps_on_cuda():
    from pdserve.kernels import load_triton_kernels

    assert load_triton_kernels()
    model = tiny_model("cuda")
    eager = DeviceRunner(model, kv_cache(64, "cuda"), BS * BLOCKS_PER_SEQ, [])
    graphs = DeviceRunner(model, kv_cache(64, "cuda"), BS * BLOCKS_PER_SEQ, [1, 2, 4])
    assert graph_blockers(torch.device("cuda")) == []
    graphs.prepare()
    (want, got), paths, _ = drive(
        SCHEDULE,
        random_prompts(SCHEDULE_PROMPTS),
        [eager.execute, graphs.execute],
        graphs.graphs,
    )
    assert paths == [False, True, False, True, False, False, True, True]
    for step, (w, g) in enumerate(zip(want, got, strict=True)):
        # Eager steps trim the block tables, graphs use the full width: the decode
        # kernel's split-K plan differs, so fp32 sums round differently.
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"step {step}")


@needs_cuda
def test_engine_on_cuda_generates_the_cpu_engine_tokens(tmp_path):
    folder = _write_checkpoint(tmp_path / "tiny")
    args = dict(model=folder, max_num_seqs=5, max_num_batched_tokens=24, num_threads=1)
    prompts = random_prompts([3, 30, 12, 50, 7, 21], seed=5)
    want = _generate(EngineCore(num_kv_blocks=48, **args), prompts)
    # A budget of about 1.5 GiB: enough blocks, yet a block list the scheduler builds fast.
    utilization = 1.5 * GiB / torch.cuda.mem_get_info()[1]
    gpu = EngineCore(device="cuda", gpu_memory_utilization=utilization, **args)
    kv = gpu.executor.worker.kv_cache
    assert kv.storage.is_cuda and kv.num_blocks > 48
    assert kv.num_blocks * kv.shape.bytes_per_block <= 1.5 * GiB
    assert gpu.executor.worker.runner.device_runner.graphs is not None
    assert _generate(gpu, prompts) == want


@needs_cuda
def test_sampler_takes_cuda_logits_with_every_knob():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen).cuda()
    knobs = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=5, seed=1, logprobs=3),
        dict(temperature=1.0, top_p=0.5, min_p=0.1, seed=2, repetition_penalty=1.3),
        dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=4),
    ]
    requests = []
    for i, params in enumerate(knobs):
        req = Request(
            f"r{i}", [1, 2, 3], SamplingParams(**params), eos_token_ids=frozenset({0}), seed=i
        )
        req.output_token_ids = [5, 5, 7]
        requests.append(req)
    tokens, logprobs = Sampler().sample(logits, requests)
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] in logits[1].topk(5).indices.tolist()
    assert logprobs[1] is not None and logprobs[1].token_id == tokens[1]
    assert tokens[3] != 0  # eos suppressed before min_tokens
