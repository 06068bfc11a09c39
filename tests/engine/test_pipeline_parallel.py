"""Pipeline-parallel worker groups on CPU (gloo): stages of contiguous layers compute
what the whole model does (alone and with TP inside each stage), each stage holds only
its layers, a size above the layer count is refused in one line, a step's chunks split
into micro-batches, and a rank that dies takes its group down."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from pdserve.common.model_split import PipelineParallelError, stage_layers
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.pipeline import micro_batches
from pdserve.engine.worker_group import WorkerGroupFailed
from pdserve.scheduler.outputs import ScheduledChunk
from tests.engine.test_tensor_parallel import (
    PROMPTS,
    _assert_same,
    _llm,
    _run,
    qwen3,
    write_tiny_qwen3,
)
from tests.processes import still_running

__all__ = ["qwen3"]  # the tiny random Qwen3 fixture (2 layers, 4 KV heads), shared


def _pp(model: str | None, tp: int, pp: int, **kwargs):
    return _llm(model, tp, pipeline_parallel_size=pp, **kwargs)


@pytest.mark.slow
def test_pp2_and_tp2_pp2_compute_what_tp1_does_on_a_tiny_qwen3(qwen3) -> None:
    whole_llm = _llm(qwen3, 1)
    whole = _run(whole_llm, PROMPTS)
    whole_weights = whole_llm.engine.info.weight_bytes
    for tp in (1, 2):
        split_llm = _pp(qwen3, tp, 2)
        _assert_same(whole, _run(split_llm, PROMPTS), 1e-4)
        ranks = split_llm.engine.executor.rank_infos
        split_llm.engine.shutdown()
        assert len(ranks) == 2 * tp
        # Stage 0: the embedding and layer 0; stage 1: layer 1, the norm and the head.
        assert [r.kv.first_layer for r in ranks] == [0] * tp + [1] * tp
        assert all(r.kv.num_layers == 1 and r.kv.model_layers == 2 for r in ranks)
        assert all(r.weight_bytes <= 0.6 * whole_weights / tp for r in ranks), (
            [r.weight_bytes for r in ranks], whole_weights)  # fmt: skip


@pytest.fixture(scope="module")
def odd_qwen3(tmp_path_factory) -> str:
    """3 layers (stages of 2 and 1) and a tied head (the last stage holds the table too)."""
    torch.manual_seed(1)
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "odd", 3, True)


@pytest.mark.slow
def test_uneven_stages_with_a_tied_head_and_chunked_prompts(odd_qwen3) -> None:
    prompts = [*PROMPTS, [4] * 70]  # 70 tokens: chunks of 32, mid-prompt steps sample nothing
    whole = _run(_llm(odd_qwen3, 1, max_num_batched_tokens=32), prompts)
    split_llm = _pp(odd_qwen3, 1, 2, max_num_batched_tokens=32)
    _assert_same(whole, _run(split_llm, prompts), 1e-4)
    ranks = split_llm.engine.executor.rank_infos
    split_llm.engine.shutdown()
    assert [(r.kv.first_layer, r.kv.num_layers) for r in ranks] == [(0, 2), (2, 1)]
    assert ranks[0].kv.num_blocks == ranks[1].kv.num_blocks  # the smaller pool bounds both


@pytest.mark.slow
def test_pp2_on_the_embedded_model() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    whole = _run(_llm(None, 1), prompts)
    split_llm = _pp(None, 1, 2)
    _assert_same(whole, _run(split_llm, prompts), 1e-4)
    split_llm.engine.shutdown()


def test_a_pp_size_above_the_layer_count_is_refused_in_one_line(qwen3) -> None:
    started = time.monotonic()
    with pytest.raises(PipelineParallelError) as refused:
        _pp(qwen3, 1, 3)
    message = str(refused.value)
    assert "\n" not in message and "3 exceeds the model's 2 layers" in message
    assert time.monotonic() - started < 5  # refused before any rank process started


def test_stages_split_the_layers_contiguously_and_unevenly() -> None:
    assert [stage_layers(30, 4, s) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layers(2, 2, s) for s in range(2)] == [(0, 1), (1, 2)]


class _Request:
    def __init__(self, n: int) -> None:
        self.request_id, self.num_computed_tokens = f"r{n}", 0


def test_a_step_splits_into_micro_batches_of_whole_requests_balanced_by_tokens() -> None:
    def chunks(*sizes: int) -> list[ScheduledChunk]:
        return [ScheduledChunk(_Request(i), 0, n, []) for i, n in enumerate(sizes)]

    def sizes(groups) -> list[list[int]]:
        return [[c.num_new_tokens for c in g] for g in groups]

    assert sizes(micro_batches(chunks(1, 1, 1, 1), 2)) == [[1, 1], [1, 1]]
    assert sizes(micro_batches(chunks(1, 1, 1), 4)) == [[1], [1], [1]]  # fewer than stages
    assert sizes(micro_batches(chunks(40, 1, 1, 1), 2)) == [[40], [1, 1, 1]]
    assert sizes(micro_batches(chunks(1, 1, 1, 40), 2)) == [[1, 1, 1], [40]]
    assert sizes(micro_batches(chunks(5), 2)) == [[5]]


@pytest.mark.slow
def test_a_rank_that_dies_takes_the_pipeline_group_down(qwen3) -> None:
    llm = _pp(qwen3, 1, 2, max_num_seqs=4)
    pids = llm.engine.executor.rank_pids
    failure: list[BaseException] = []

    def generate() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        try:
            llm.generate([PROMPTS[1]] * 32, params)  # 8 waves of 4: still running at 1 s
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failure.append(exc)

    worker = threading.Thread(target=generate)
    worker.start()
    time.sleep(1.0)  # under way
    os.kill(pids[0], signal.SIGKILL)  # the first stage: the last one waits on its sends
    worker.join(timeout=30)
    assert not worker.is_alive(), "generation hung after a rank died"
    assert failure and isinstance(failure[0], WorkerGroupFailed), failure
    assert "rank 0" in str(failure[0])
    assert not still_running(pids, 10)


# ---- micro-batches overlap: two real gloo ranks, a model that only takes time ----------

STEP_S = 0.3  # one micro-batch's compute on one stage


class _SlowModel:
    """Each micro-batch costs STEP_S on every stage (a sleep: it needs no core)."""

    class cfg:  # noqa: N801 - shaped like a model config
        hidden_size = 8

    hidden_dtype = torch.float32

    def __init__(self, last: bool) -> None:
        self.last = last

    def __call__(self, token_ids, positions, layers, meta, carried=None):
        time.sleep(STEP_S)
        n = token_ids.shape[0]
        return torch.zeros(n, 8) if self.last else torch.zeros(2, n, 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], 4)


class _FakeWorker:
    def __init__(self, stage) -> None:
        from types import SimpleNamespace

        self.stage, self.device = stage, torch.device("cpu")
        self.model = _SlowModel(stage.is_last)
        self.kv_cache = SimpleNamespace(layers=[])
        self.runner = SimpleNamespace(prepare=self._prepare, on_device=lambda batch: batch)

    @staticmethod
    def _prepare(group):
        from types import SimpleNamespace

        tokens = sum(c.num_new_tokens for c in group)
        return SimpleNamespace(
            num_tokens=tokens, token_ids=torch.zeros(tokens, dtype=torch.long), positions=None,
            meta=None, sampling_requests=[c.request for c in group],
            logits_indices=torch.arange(len(group)),
        )  # fmt: skip

    def forward_began(self) -> float:  # the forward is not timed here
        return 0.0

    def forward_ended(self, began: float) -> None:
        pass

    def take_logits(self, logits, batch):
        from pdserve.engine.step_plan import SampledToken

        requests = batch.sampling_requests
        for request in requests:  # as ModelWorker.take_logits: the mirror takes its token
            request.output_token_ids.append(7)
        return [SampledToken(r.request_id, 7) for r in requests]


class _Mirror:
    def __init__(self, n: int) -> None:
        self.request_id, self.output_token_ids = f"r{n}", []


def _stage_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from pdserve.engine.pipeline import PipelineStage, run_stage

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    worker = _FakeWorker(PipelineStage.of(2, 2, rank))
    timings = []
    for _ in range(2):  # the first step also sets up the connections
        chunks = [ScheduledChunk(_Mirror(i), 0, 4, []) for i in range(4)]
        started = time.perf_counter()
        run_stage(worker, chunks)
        timings.append(time.perf_counter() - started)
        assert all(c.request.output_token_ids == [7] for c in chunks)  # both stages learn them
    results.put((rank, timings[-1]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_micro_batches_overlap_across_stages() -> None:
    """2 stages, 2 micro-batches of STEP_S each: overlapped, a step takes 3 x STEP_S
    (stage 1 computes micro-batch 0 while stage 0 computes 1); one after the other, 4;
    as one batch (the fake model costs STEP_S a call, whatever its size), 2."""
    import multiprocessing as mp

    from pdserve.engine.ranks import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_stage_rank, args=(r, port, results)) for r in range(2)]
    for process in ranks:
        process.start()
    timings = dict(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=30)
    assert all(p.exitcode == 0 for p in ranks)
    assert 2.9 * STEP_S < timings[1] < 3.5 * STEP_S, timings
