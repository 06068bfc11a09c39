"""Where an 8B-shaped engine step spends its GPU time: the kernels of one decode step
at batch 64 (1k context) and of one 4096-token prefill, from torch's profiler.

    python -m experiments.gpu_profile [--dry-run-cpu]

The `decode-step` section of the device check says whether a step meets its target; this
says which kernels a missed target should look at. Eager steps are profiled (each
kernel's GPU time is the same as inside a CUDA graph; only the launch gaps differ).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from experiments.gpu_engine import BLOCK_SIZE, DRY_SHAPE, kv_cache_for
from pdserve.engine.device_runner import DeviceRunner
from pdserve.engine.step_inputs import build_step_inputs, contiguous_block_tables
from pdserve.engine.synthetic_model import llama_8b_shape, random_llama

ROWS = 14


def profile_step(name: str, run, device: torch.device, repeats: int) -> None:
    """The kernels of `run()` by their GPU time per call, largest first."""
    for _ in range(2):
        run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n{name} ({repeats} calls; times are totals over them):")
    print(prof.key_averages().table(sort_by=key, row_limit=ROWS, max_name_column_width=60))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_profile")
    parser.add_argument("--dry-run-cpu", action="store_true")
    args = parser.parse_args(argv)
    dry = args.dry_run_cpu
    device = torch.device("cpu" if dry else "cuda")
    cfg, dtype = (DRY_SHAPE, torch.float32) if dry else (llama_8b_shape(), torch.bfloat16)
    batch, context, max_len = (4, 48, 128) if dry else (64, 1024, 2048)
    model = random_llama(cfg, dtype, device, seed=0)
    kv = kv_cache_for(cfg, batch * (max_len // BLOCK_SIZE), dtype, device)
    kv.storage.normal_()
    runner = DeviceRunner(model, kv, max_len, [batch], capture=False)
    runner.prepare()
    tables = contiguous_block_tables(batch, max_len // BLOCK_SIZE)
    decode = build_step_inputs([([1], context - 1)] * batch, tables, BLOCK_SIZE)
    profile_step(
        f"decode step, batch {batch}, context {context}",
        lambda: runner.execute_eagerly(decode),
        device,
        5,
    )
    tokens = 64 if dry else 4096
    prompt = torch.randint(0, cfg.vocab_size, (tokens,)).tolist()
    prefill = build_step_inputs(
        [(prompt, 0)], contiguous_block_tables(1, -(-tokens // BLOCK_SIZE)), BLOCK_SIZE
    )
    profile_step(f"prefill of {tokens} tokens", lambda: runner.execute_eagerly(prefill), device, 3)


if __name__ == "__main__":
    main()
