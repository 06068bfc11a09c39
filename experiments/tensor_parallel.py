"""Per-step time of a tensor-parallel worker group against one process, and the share of
it spent in collectives (rank 0's all-reduces and logits gather).

    python -m experiments.tensor_parallel [--sizes 1 2] [--threads 2]

A synthetic Llama of about 1 GiB (hidden 1024, 12 layers, 16 query / 4 KV heads, vocab
32768, float32) is written to a temporary folder; each TP size serves the same batch
(8 requests of 64 prompt tokens, 32 output tokens each) through `EngineCore`. Prefill
and decode steps are timed apart. All sizes share the same total thread count, so the
figure says what splitting one machine's cores costs or gains, not what more hardware
buys.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.core import EngineCore
from pdserve.engine.synthetic_model import SyntheticLlamaConfig, random_llama, save_checkpoint
from pdserve.scheduler.sampling_params import SamplingParams

SHAPE = dict(
    vocab_size=32768, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
    num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
)  # fmt: skip


def write_model(folder: Path) -> str:
    model = random_llama(SyntheticLlamaConfig(**SHAPE), torch.float32, "cpu")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              **SHAPE}  # fmt: skip
    return save_checkpoint(model, folder, config)


def measure(model: str, tp: int, threads: int, batch: int, prompt: int, output: int) -> dict:
    engine = EngineCore(
        model=model, dtype="float32", num_threads=threads, num_kv_blocks=256,
        max_model_len=512, tensor_parallel_size=tp,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * i + j) % 30000 + 3 for j in range(prompt)]
        engine.add_request(engine.make_request(f"r{i}", ids, params))
    prefill, decode, shares = [], [], []
    while engine.has_unfinished_requests():
        before_model, before_coll = engine.stats.model_seconds, engine.stats.collective_seconds
        started = time.perf_counter()
        output_ = engine.scheduler.schedule()
        decoding = all(c.num_new_tokens == 1 for c in output_.chunks)
        engine.execute(output_)
        elapsed = time.perf_counter() - started
        (decode if decoding else prefill).append(elapsed)
        model_s = engine.stats.model_seconds - before_model
        if decoding and model_s > 0:
            shares.append((engine.stats.collective_seconds - before_coll) / model_s)
    engine.shutdown()
    return {
        "tp": tp,
        "prefill_ms": 1000 * statistics.median(prefill),
        "decode_ms": 1000 * statistics.median(decode[2:] or decode),
        "collective_share": statistics.median(shares) if shares else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model")
        rows = [
            measure(model, tp, args.threads, args.batch, args.prompt, args.output)
            for tp in args.sizes
        ]
    print(f"batch {args.batch} x {args.prompt} prompt tokens, {args.output} output tokens, "
          f"{args.threads} threads in all")  # fmt: skip
    print("| TP | prefill step (ms) | decode step (ms) | collectives share of a decode step |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['tp']} | {row['prefill_ms']:.1f} | {row['decode_ms']:.1f} | "
              f"{100 * row['collective_share']:.0f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
