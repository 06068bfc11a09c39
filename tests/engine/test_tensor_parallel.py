"""Tensor-parallel worker groups on CPU (gloo): the split model computes what the whole one
does, each rank holds only its slice, a size the heads cannot be split by is refused in one
line, and a rank that dies takes its group down at once with no process left behind."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from pdserve.common.model_split import TensorParallelError
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.embedded import embedded_model_path
from pdserve.engine.worker_group import WorkerGroupFailed
from tests.processes import still_running

pytestmark = pytest.mark.slow

VOCAB = 1001  # odd: the vocabulary-split embedding and LM head are padded on the last rank
PROMPTS = [[5, 17, 300, 42, 7], list(range(100, 140)), [999, 1000, 3]]


def write_tiny_qwen3(folder: Path, num_hidden_layers: int, tie_word_embeddings: bool) -> str:
    """A tiny random Qwen3 (q/k norms) with 8 query and 4 KV heads and the embedded
    model's tokenizer, written to `folder`."""
    import transformers as tf

    config = tf.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=num_hidden_layers, num_attention_heads=8, num_key_value_heads=4,
        head_dim=16, max_position_embeddings=512, initializer_range=0.3,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    tf.Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_path() / name, folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    """2 layers, an untied head."""
    torch.manual_seed(0)
    return write_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny", 2, False)


def _llm(model: str | None, tp: int, **kwargs):
    from pdserve import LLM

    return LLM(
        model=model, dtype="float32", num_threads=2, kv_cache_memory=16 << 20,
        max_model_len=256, tensor_parallel_size=tp, **kwargs,
    )  # fmt: skip


def _engine(model: str, tp: int):
    from pdserve.engine.core import EngineCore

    return EngineCore(
        model=model, dtype="float32", num_threads=2, num_kv_blocks=64, max_model_len=256,
        tensor_parallel_size=tp,
    )  # fmt: skip


def _run(llm, prompts) -> list:
    """Each prompt's (completion, prompt logprobs): the prompt's scored on the ranks too."""
    params = SamplingParams(
        temperature=0.0, max_tokens=12, logprobs=5, prompt_logprobs=2, ignore_eos=True
    )
    return [(o.outputs[0], o.prompt_logprobs) for o in llm.generate(prompts, params)]


def _assert_same(whole, split, tolerance: float) -> None:
    for (a, a_prompt), (b, b_prompt) in zip(whole, split, strict=True):
        assert a.token_ids == b.token_ids
        assert a_prompt[0] is None and b_prompt[0] is None and len(a_prompt) == len(b_prompt)
        for x, y in zip([*a.logprobs, *a_prompt[1:]], [*b.logprobs, *b_prompt[1:]], strict=True):
            assert x.top_ids == y.top_ids and x.rank == y.rank
            pairs = zip([x.logprob, *x.top_logprobs], [y.logprob, *y.top_logprobs], strict=True)
            assert max(abs(u - v) for u, v in pairs) < tolerance


def test_tp2_computes_what_tp1_does_on_a_tiny_qwen3(qwen3) -> None:
    whole = _run(_llm(qwen3, 1), PROMPTS)
    split_llm = _llm(qwen3, 2)
    _assert_same(whole, _run(split_llm, PROMPTS), 1e-4)
    split_llm.engine.shutdown()


def test_tp3_on_the_embedded_model_and_tp2_refused() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    whole = _run(_llm(None, 1), prompts)
    split_llm = _llm(None, 3)
    _assert_same(whole, _run(split_llm, prompts), 1e-4)
    split_llm.engine.shutdown()
    with pytest.raises(TensorParallelError) as refused:
        _llm(None, 2)
    message = str(refused.value)
    assert "\n" not in message and "3 KV heads" in message and "9 attention heads" in message


def test_tp3_int8_computes_what_tp1_int8_does_on_the_embedded_model() -> None:
    """Ranks hold their int8 rows (QKV, gate/up) or columns (output, down, with their
    groups' scales): the split model's tokens and log-probabilities are the whole one's."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    whole = _run(_llm(None, 1, quantization="int8"), prompts)
    split_llm = _llm(None, 3, quantization="int8")
    _assert_same(whole, _run(split_llm, prompts), 1e-4)
    split_llm.engine.shutdown()


def test_each_rank_reads_and_holds_only_its_shard(tmp_path) -> None:
    """About 1 GiB of float32 weights: at TP=2 each rank's parameters and the memory its
    load took are at most 0.6x those of TP=1 (a rank that read whole tensors fails)."""
    folder = _write_synthetic(tmp_path / "big")
    whole_weights, whole_peak = _whole_in_a_fresh_process(folder)
    split = _engine(folder, 2)
    ranks = split.executor.rank_infos
    split.shutdown()
    assert whole_weights > 900 << 20
    for rank in ranks:
        assert rank.weight_bytes <= 0.6 * whole_weights, (rank.weight_bytes, whole_weights)
        assert rank.load_peak_memory_bytes <= 0.6 * whole_peak, (
            rank.load_peak_memory_bytes, whole_peak)  # fmt: skip


def _whole_in_a_fresh_process(folder: str) -> tuple[int, int]:
    """TP=1's weight bytes and load peak, measured in a new process as each rank's are: a
    long-lived test process holds memory freed by earlier tests, which a load reuses
    without raising its resident peak."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from tests.engine.test_tensor_parallel import _engine\n"
        "engine = _engine(sys.argv[1], 1)\n"
        "print('sizes', engine.info.weight_bytes, engine.info.load_peak_memory_bytes)\n"
        "engine.shutdown()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [row for row in done.stdout.splitlines() if row.startswith("sizes ")]
    _, weights, peak = line.split()
    return int(weights), int(peak)


def _write_synthetic(folder) -> str:
    from pdserve.engine.synthetic_model import SyntheticLlamaConfig, random_llama, save_checkpoint

    cfg = SyntheticLlamaConfig(
        vocab_size=32768, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
    )  # fmt: skip
    model = random_llama(cfg, torch.float32, "cpu")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "vocab_size": 32768, "hidden_size": 1024,
        "intermediate_size": 4096, "num_hidden_layers": 12, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 256,
    }  # fmt: skip
    path = save_checkpoint(model, folder, config)
    del model
    return path


def test_a_rank_that_dies_takes_the_group_down(qwen3) -> None:
    llm = _llm(qwen3, 2, max_num_seqs=4)
    pids = llm.engine.executor.rank_pids
    failure: list[BaseException] = []

    def generate() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        try:
            llm.generate([PROMPTS[1]] * 4, params)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failure.append(exc)

    worker = threading.Thread(target=generate)
    worker.start()
    time.sleep(1.0)  # under way
    os.kill(pids[1], signal.SIGKILL)
    worker.join(timeout=30)
    assert not worker.is_alive(), "generation hung after a rank died"
    assert failure and isinstance(failure[0], WorkerGroupFailed), failure
    assert "rank 1" in str(failure[0])
    assert not still_running(pids, 10)
    with pytest.raises(WorkerGroupFailed):  # and it stays failed
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
