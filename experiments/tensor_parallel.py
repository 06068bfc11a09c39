"""Per-step time of tensor- and pipeline-parallel worker groups against one process, and
the shares of it spent in collectives (the sampling rank's all-reduces and logits gather)
and in sends and receives between pipeline stages (the most any rank waited on them).

    python -m experiments.tensor_parallel [--sizes 1x1 2x1 1x2] [--threads 2]

Each size is TPxPP. A synthetic Llama of about 1 GiB (hidden 1024, 12 layers, 16 query
/ 4 KV heads, vocab 32768, float32) is written to a temporary folder; each size serves
the same batch (8 requests of 64 prompt tokens, 32 output tokens each) through
`EngineCore`. Prefill and decode steps are timed apart; at PP=2 a step runs as 2
micro-batches. All sizes share the same total thread count, so the figure says what
splitting one machine's cores costs or gains, not what more hardware buys.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core import EngineCore
from pdserve.engine.synthetic_model import SyntheticLlamaConfig, random_llama, save_checkpoint

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


def measure(model: str, size: str, threads: int, batch: int, prompt: int, output: int) -> dict:
    tp, pp = (int(n) for n in size.split("x"))
    engine = EngineCore(
        model=model, dtype="float32", num_threads=threads, num_kv_blocks=256,
        max_model_len=512, tensor_parallel_size=tp, pipeline_parallel_size=pp,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(batch):
        ids = [(7 * i + j) % 30000 + 3 for j in range(prompt)]
        engine.add_request(engine.make_request(f"r{i}", ids, params))
    prefill, decode, shares, stage_shares = [], [], [], []
    stats = engine.stats
    while engine.has_unfinished_requests():
        before_model, before_coll = stats.model_seconds, stats.collective_seconds
        before_stage = stats.stage_transfer_seconds
        started = time.perf_counter()
        output_ = engine.scheduler.schedule()
        decoding = all(c.num_new_tokens == 1 for c in output_.chunks)
        engine.execute(output_)
        elapsed = time.perf_counter() - started
        (decode if decoding else prefill).append(elapsed)
        model_s = engine.stats.model_seconds - before_model
        if decoding and model_s > 0:
            shares.append((stats.collective_seconds - before_coll) / model_s)
            stage_shares.append((stats.stage_transfer_seconds - before_stage) / model_s)
    engine.shutdown()
    return {
        "tp": tp,
        "pp": pp,
        "stage_share": statistics.median(stage_shares) if stage_shares else 0.0,
        "prefill_ms": 1000 * statistics.median(prefill),
        "decode_ms": 1000 * statistics.median(decode[2:] or decode),
        "collective_share": statistics.median(shares) if shares else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model")
        rows = [
            measure(model, size, args.threads, args.batch, args.prompt, args.output)
            for size in args.sizes
        ]
    print(f"batch {args.batch} x {args.prompt} prompt tokens, {args.output} output tokens, "
          f"{args.threads} threads in all")  # fmt: skip
    print("| TP | PP | prefill step (ms) | decode step (ms) | collectives share of a decode "
          "step | stage sends/receives share |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['tp']} | {row['pp']} | {row['prefill_ms']:.1f} | "
              f"{row['decode_ms']:.1f} | {100 * row['collective_share']:.0f}% | "
              f"{100 * row['stage_share']:.0f}% |")  # fmt: skip


if __name__ == "__main__":
    main()
