"""The GPU half's plumbing on a `cuda` device of fake tensors (`tests/engine/fake_cuda.py`):
a whole-model rank loads, allocates its KV cache and runs steps on the device; each
pipeline stage runs its part of a step there, its step inputs and the states it receives
on the device; a tensor-parallel rank loads its slice onto the device; step inputs are
staged onto it. A host tensor meeting a device tensor fails, as on a GPU. The Triton
kernels run through their fake implementations, whose calls the tests count."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.step_inputs import build_step_inputs, contiguous_block_tables
from pdserve.engine.step_plan import NewRequest, PlannedChunk, StepPlan
from pdserve.engine.synthetic_model import (
    building_on,
    hf_fields,
    random_llama,
    save_checkpoint,
    small_llama_shape,
)
from pdserve.engine.worker import ModelWorker
from pdserve.scheduler.outputs import ScheduledChunk
from tests.engine.fake_cuda import CUDA, SamplerSeam, SeamStage, fake_cuda

BS = 16
CFG = small_llama_shape(vocab_size=256, max_position_embeddings=8 * BS)
PROMPTS = {"a": list(range(1, 21)), "b": list(range(30, 35))}  # 2 blocks, 1 block
TRITON_OPS = {
    "pdserve::write_kv_cache",
    "pdserve::decode_attention",
    "pdserve::prefill_attention",
    "pdserve::rms_norm",
    "pdserve::rms_norm_residual",
    "pdserve::rotary_embedding",
    "pdserve::silu_and_mul",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    model = random_llama(CFG, torch.float32, "cpu")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        **hf_fields(CFG, "rope_theta", "rms_norm_eps"),
    }
    return save_checkpoint(model, tmp_path_factory.mktemp("fake_cuda") / "tiny", config)


def _worker(checkpoint: str, tp: TensorParallel | None = None, stage=None) -> ModelWorker:
    config = EngineConfig(
        model=checkpoint, device="cuda", dtype="bfloat16", enforce_eager=True,
        num_kv_blocks=8, max_model_len=8 * BS, num_threads=1,
    )  # fmt: skip
    worker = ModelWorker(config, tp=tp, stage=stage)
    worker.load()
    worker.sampler = SamplerSeam(CFG.vocab_size)
    return worker


def _prefill_plan() -> StepPlan:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    return StepPlan(
        new_requests=[NewRequest(rid, p, [], params, 0) for rid, p in PROMPTS.items()],
        chunks=[PlannedChunk("a", 0, 20, [0, 1]), PlannedChunk("b", 0, 5, [2])],
    )


def _decode_plan() -> StepPlan:
    return StepPlan(chunks=[PlannedChunk("a", 20, 1, []), PlannedChunk("b", 5, 1, [])])


def _on_device(model: torch.nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device == CUDA, f"{name} on {tensor.device}"


def test_a_host_tensor_fed_to_a_model_on_cuda_fails(monkeypatch) -> None:
    steps = build_step_inputs([(PROMPTS["a"], 0)], contiguous_block_tables(1, 2), BS)
    with fake_cuda(monkeypatch), building_on("cuda", torch.bfloat16):
        model = LlamaForCausalLM(CFG)
        caches = [torch.zeros(4, 2, 2, BS, 16) for _ in range(2)]
        with pytest.raises(FakeTensorDeviceMismatchError, match="cuda:0 and cpu"):
            model(steps.token_ids, steps.positions, caches, steps.meta)


def test_a_whole_model_rank_loads_and_steps_on_cuda(monkeypatch, checkpoint) -> None:
    with fake_cuda(monkeypatch) as fake:
        worker = _worker(checkpoint)
        _on_device(worker.model)
        assert worker.kv_cache.storage.device == CUDA
        assert worker.kv_cache.storage.shape == (8, 2, 2, 2, BS, 16)
        assert worker.kv_cache.storage.dtype == torch.bfloat16
        assert worker.runner.device_runner is not None
        first = worker.execute(_prefill_plan())
        second = worker.execute(_decode_plan())
    assert [s.token_id for s in first.sampled + second.sampled] == [7] * 4
    assert worker.sampler.handed == [((2, CFG.vocab_size), torch.float32, CUDA)] * 2
    assert set(fake.ops.names) >= TRITON_OPS


def test_prompt_rows_are_scored_from_the_devices_logits(monkeypatch, checkpoint) -> None:
    """A step of prompts that ask for prompt logprobs runs eagerly and scores every
    position before the last of each prompt (values need real tensors: recorded here)."""
    import pdserve.engine.worker as worker_module

    scored = []
    monkeypatch.setattr(
        worker_module, "describe_rows",
        lambda rows, ids, k: scored.append((tuple(rows.shape), rows.device, len(ids), k)) or [],
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
    plan = StepPlan(
        new_requests=[NewRequest(rid, p, [], params, 0) for rid, p in PROMPTS.items()],
        chunks=[PlannedChunk("a", 0, 20, [0, 1]), PlannedChunk("b", 0, 5, [2])],
    )
    with fake_cuda(monkeypatch):
        worker = _worker(checkpoint)
        result = worker.execute(plan)
    vocab = CFG.vocab_size
    assert scored == [((19, vocab), CUDA, 19, 1), ((4, vocab), CUDA, 4, 1)]
    assert [(p.request_id, p.first) for p in result.prompt_logprobs] == [("a", 1), ("b", 1)]
    assert worker.sampler.handed == [((2, vocab), torch.float32, CUDA)]  # sampling rows only


@pytest.mark.parametrize("index", [0, 1])
def test_each_pipeline_stage_runs_its_step_on_cuda(monkeypatch, checkpoint, index) -> None:
    """Stage 0 embeds the step's tokens and sends [2, tokens, hidden] on; stage 1
    receives that onto the device, runs its layer and the head, and samples."""
    stage = SeamStage.of(CFG.num_hidden_layers, 2, index)
    with fake_cuda(monkeypatch) as fake:
        worker = _worker(checkpoint, stage=stage)
        _on_device(worker.model)
        assert worker.kv_cache.storage.shape == (8, 1, 2, 2, BS, 16)
        assert worker.kv_cache.storage.device == CUDA
        worker.execute(_prefill_plan())
        worker.execute(_decode_plan())
    # Each step: two micro-batches of one request each (prompts, then decodes).
    moved = [(2, 20, 64), (2, 5, 64), (2, 1, 64), (2, 1, 64)]
    assert fake.collectives.named("isend" if index == 0 else "recv") == moved
    assert fake.collectives.named("recv" if index == 0 else "isend") == []
    assert stage.devices_handed == [CUDA] * 3  # the block count's minimum, two token steps
    one_row = ((1, CFG.vocab_size), torch.float32, CUDA)
    assert worker.sampler.handed == ([] if index == 0 else [one_row] * 4)
    assert set(fake.ops.names) >= {"pdserve::write_kv_cache", "pdserve::prefill_attention"}


def test_a_tensor_parallel_rank_loads_its_slice_onto_cuda(monkeypatch, checkpoint) -> None:
    with fake_cuda(monkeypatch) as fake:
        worker = _worker(checkpoint, tp=TensorParallel(1, 2))
        _on_device(worker.model)
        attn, mlp = worker.model.layers[0].attn, worker.model.layers[0].mlp
        assert attn.qkv_weight.shape == ((2 + 2 * 1) * 16, 64)  # 2 query heads, 1 KV head
        assert attn.o_weight.shape == (64, 2 * 16)
        assert mlp.gate_up_weight.shape == (2 * 64, 64)
        assert mlp.down_weight.shape == (64, 64)
        assert worker.model.embed.shape == worker.model.lm_head.shape == (128, 64)
        assert worker.kv_cache.storage.shape == (8, 2, 2, 1, BS, 16)
        worker.execute(_prefill_plan())
    # One all-reduce after the embedding, the attention and the MLP of each layer.
    assert fake.collectives.named("all_reduce") == [(25, 64)] * 5
    assert fake.collectives.named("all_gather") == [(2, 128)] * 3  # the logits, 2 ranks
    assert worker.sampler.handed == [((2, CFG.vocab_size), torch.float32, CUDA)]


def test_step_inputs_are_staged_on_the_device(monkeypatch, checkpoint) -> None:
    with fake_cuda(monkeypatch):
        worker = _worker(checkpoint)
        plan = _prefill_plan()
        worker._update_requests(plan)
        chunks = [
            ScheduledChunk(
                worker.requests[c.request_id], c.start, c.num_new_tokens, c.new_block_ids
            )
            for c in plan.chunks
        ]
        host = worker.runner.prepare(chunks)
        staged = worker.runner.on_device(host)
    tensors = {
        "token_ids": (host.token_ids, staged.token_ids),
        "positions": (host.positions, staged.positions),
        "logits_indices": (host.logits_indices, staged.logits_indices),
        "slot_mapping": (host.meta.slot_mapping, staged.meta.slot_mapping),
        "block_tables": (host.meta.block_tables, staged.meta.block_tables),
        "query_start_loc": (host.meta.query_start_loc, staged.meta.query_start_loc),
        "context_lens": (host.meta.context_lens, staged.meta.context_lens),
    }
    for name, (before, after) in tensors.items():
        assert before.device.type == "cpu", name
        assert after.device == CUDA, name
        assert (after.shape, after.dtype) == (before.shape, before.dtype), name
    assert staged.sampling_requests == host.sampling_requests


def test_an_fp8_kv_cache_is_refused_on_cuda_in_one_line(monkeypatch, checkpoint) -> None:
    """The CUDA kernels have no FP8 KV cache: refused where the settings are made, before
    any weight loads, and an FP8 scale handed to a CUDA attention op fails, not ignored."""
    with fake_cuda(monkeypatch):
        with pytest.raises(ValueError) as refused:
            EngineConfig(model=checkpoint, device="cuda", kv_cache_dtype="fp8_e5m2")
        assert str(refused.value) == (
            "kv_cache_dtype fp8_e5m2 runs on CPU (its C kernels); the CUDA kernels have no "
            "FP8 KV cache (device cuda): use auto there"
        )
        from pdserve.kernels import decode_attention

        query = torch.empty(1, 4, 16, device=CUDA)
        cache = torch.empty(2, 2, 2, BS, 16, device=CUDA)
        tables = torch.zeros(1, 1, dtype=torch.int32, device=CUDA)
        lens = torch.ones(1, dtype=torch.int32, device=CUDA)
        with pytest.raises(NotImplementedError, match="k_scale: the CUDA kernels have no FP8"):
            decode_attention(query, cache, tables, lens, 0.25, k_scale=2.0)


def test_a_rank_loads_and_sizes_its_cache_in_its_gpus_turn(monkeypatch, checkpoint, tmp_path):
    """Instances sharing a GPU load and size one at a time (`gpu_memory.sizing_turn`)."""
    from pdserve.engine import gpu_memory, worker
    from tests.engine.test_gpu_memory import turn_is_held

    monkeypatch.setattr(gpu_memory.tempfile, "gettempdir", lambda: str(tmp_path))
    lock = gpu_memory.sizing_lock_path(CUDA)
    held: dict[str, bool] = {}

    def recording(name: str, make):
        def record(*args, **kwargs):
            held[name] = turn_is_held(lock)
            return make(*args, **kwargs)

        return record

    monkeypatch.setattr(worker, "load_model", recording("weights", worker.load_model))
    monkeypatch.setattr(worker, "KVCache", recording("kv cache", worker.KVCache))
    with fake_cuda(monkeypatch):
        _worker(checkpoint)
    assert held == {"weights": True, "kv cache": True}
    assert not turn_is_held(lock)
