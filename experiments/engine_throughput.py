"""Offline generation throughput: this engine beside Hugging Face transformers.

    python -m experiments.engine_throughput [--batches 1 32] [--prompt-len 128] [--output-len 128]

Both run the same random-token prompts in the same dtype (bfloat16 by default) with the
same torch thread count, greedy, ignoring eos so every request makes exactly
`--output-len` tokens. Also prints the fraction of the weights-only ceiling: the rate at
which decode steps would run if each only streamed the weights once from memory.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import DTYPES


def measure_bandwidth(threads: int, size_mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write), best of `repeats`."""
    torch.set_num_threads(threads)
    src = torch.empty(size_mib << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def run_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outputs)
    return len(prompts) * output_len / elapsed


def run_transformers(folder: str, dtype: torch.dtype, prompts: list[list[int]], n: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + n
    return len(prompts) * n / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: embedded)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)

    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads)
    threads = torch.get_num_threads()
    model = llm.engine.executor.worker.model  # the in-process rank's
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = measure_bandwidth(threads)
    vocab = llm.engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    print(
        f"model {llm.engine.model_path} dtype {args.dtype} threads {threads} "
        f"weights {weight_bytes / 2**20:.0f} MiB, copy bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'batch':>5} {'pdserve tok/s':>14} {'transformers tok/s':>19} {'ratio':>6} {'ceiling':>8}"
    )
    for batch in args.batches:
        prompts = torch.randint(3, vocab, (batch, args.prompt_len), generator=gen).tolist()
        ours = run_engine(llm, prompts, args.output_len)
        theirs = (
            float("nan")
            if args.skip_transformers
            else run_transformers(
                llm.engine.model_path, getattr(torch, args.dtype), prompts, args.output_len
            )
        )
        torch.set_num_threads(threads)
        ceiling = batch * bandwidth / weight_bytes
        print(
            f"{batch:>5} {ours:>14.1f} {theirs:>19.1f} {ours / theirs:>6.2f} {ours / ceiling:>7.0%}"
        )


if __name__ == "__main__":
    main()
