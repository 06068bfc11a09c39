"""What the experiments that benchmark a server they start share: its flags, its
`pdserve serve` arguments, and one `pdserve bench serve` run against it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def add_server_flags(
    parser: argparse.ArgumentParser,
    kv_cache_memory: str,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> None:
    """Flags passed through to the server, with the experiment's defaults."""
    parser.add_argument("--threads-per-instance", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default=kv_cache_memory)
    parser.add_argument("--max-model-len", type=int, default=max_model_len)
    # The chunked-prefill budget of a step (both modes): a colocated decode waits for
    # the prefill chunk it shares a step with.
    parser.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens)
    parser.add_argument("--kv-transport", default="ucx")


def local_serve_args(args: argparse.Namespace) -> list[str]:
    """`pdserve serve` arguments of local instances from those flags (the KV transport
    aside: it matters to disaggregated servers only)."""
    return [
        "--launcher", "local", "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory,
        "--max-model-len", str(args.max_model_len), "--threads-per-instance",
        str(args.threads_per_instance), "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]  # fmt: skip


def run_bench_serve(
    url: str,
    args: argparse.Namespace,
    out: Path,
    rate: str,
    num_prompts: int,
    seed: int,
    *extra: str,
) -> tuple[dict, str]:
    """One `pdserve bench serve` run in its own process (prompt and output lengths from
    `args`, then `extra` flags): its saved JSON and what it printed."""
    command = [
        sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url,
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(num_prompts),
        "--request-rate", rate, "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,95,99", "--disable-tqdm", "--result-filename", str(out),
        *extra,
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"bench serve failed:\n{completed.stderr[-2000:]}")
    return json.loads(out.read_text()), completed.stdout
