"""The engine half of the device check fails when the graph path's logits go wrong, and
its transformers baseline holds the same weights as the engine's model (its dry run
without the project's other packages: `test_gpu_check.py`)."""

from __future__ import annotations

import pytest
import torch

from experiments import gpu_engine
from experiments.gpu_transformers import build_hf_llama
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.step_inputs import build_step_inputs, contiguous_block_tables
from pdserve.engine.synthetic_model import random_llama


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_greedy_check_fails_when_graph_logits_go_to_the_wrong_rows(monkeypatch, one_thread):
    run = DecodeGraphs.run

    def shifted(self, *args):
        return run(self, *args).roll(1, dims=0)

    monkeypatch.setattr(DecodeGraphs, "run", shifted)
    assert gpu_engine.run_greedy_check(torch.device("cpu"), dry_run=True) is False


@pytest.mark.slow  # importing transformers takes seconds
def test_transformers_baseline_holds_the_engine_weights(one_thread):
    cfg = gpu_engine.DRY_SHAPE
    model = random_llama(cfg, torch.float32, "cpu", seed=3, std=0.1)
    hf = build_hf_llama(model, cfg, torch.float32, torch.device("cpu"))
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    kv: KVCache = gpu_engine.kv_cache_for(cfg, 4, torch.float32, "cpu")
    inputs = build_step_inputs([(prompt.tolist(), 0)], contiguous_block_tables(1, 4), 16)
    inputs.logits_indices = torch.arange(40)
    with torch.inference_mode():
        ours = model.compute_logits(
            model(inputs.token_ids, inputs.positions, kv.layers, inputs.meta)
        )
        theirs = hf(prompt[None]).logits[0].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
