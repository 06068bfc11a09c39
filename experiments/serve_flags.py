"""The `pdserve serve` flags the experiments that start their own server share."""

from __future__ import annotations

import argparse


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
