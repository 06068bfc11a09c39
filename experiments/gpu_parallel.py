"""The `tensor-parallel` and `pipeline-parallel` sections of the device check: greedy
tokens and top-5 logprobs of `pdserve.LLM` split over two ranks (TP=2, or PP=2) equal
those of one rank, on a synthetic checkpoint (`experiments.gpu_model`).

The engine joins CUDA ranks with NCCL and gives each rank a GPU of its own. With two
GPUs visible the ranks take one each; with one the section is skipped, with the answer
of a two-process NCCL all-reduce on that one device for the record.
On CPU (the dry run) the ranks join with gloo.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from pathlib import Path

import torch

from experiments.gpu_model import model_shape, write_checkpoint
from experiments.gpu_outcome import Outcome, SectionSkipped
from pdserve.common.sampling_params import SamplingParams

PROBE_TIMEOUT_S = 15.0  # inside the section's own limit


def _probe_rank(rank: int, port: int, answers) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        value = torch.ones(1, device="cuda")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        answers.put((rank, None if float(value) == 2.0 else f"all-reduce gave {float(value)}"))
        dist.destroy_process_group()
    except Exception as exc:  # NCCL's refusal is the probe's answer
        answers.put((rank, f"{type(exc).__name__}: {exc}"))


def nccl_refusal_on_one_gpu() -> str | None:
    """NCCL's error for two ranks on cuda:0, or None when it lets them all-reduce."""
    from pdserve.engine.ranks import free_port

    context = mp.get_context("spawn")
    answers = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_probe_rank, args=(r, port, answers)) for r in (0, 1)]
    for process in ranks:
        process.start()
    errors = []
    try:
        for _ in ranks:
            _, error = answers.get(timeout=PROBE_TIMEOUT_S)
            errors += [error] if error else []
    except Exception:
        errors.append(f"no answer from both ranks within {PROBE_TIMEOUT_S:.0f} s")
    for process in ranks:
        process.join(5)
        if process.is_alive():
            process.kill()
    return errors[0] if errors else None


def two_rank_refusal(device: torch.device) -> str | None:
    if device.type == "cpu" or torch.cuda.device_count() >= 2:
        return None
    # The engine gives each rank a GPU of its own (engine/devices.py refuses a group
    # larger than the GPUs it sees), so one GPU skips; the probe says whether NCCL
    # would have allowed two ranks on it, for the record.
    refused = nccl_refusal_on_one_gpu()
    nccl = "NCCL allows two ranks on it" if refused is None else refused.splitlines()[0]
    return f"one GPU, and a worker group takes one GPU per rank (NCCL's probe: {nccl})"


def greedy(model: str, device: torch.device, tp: int, pp: int, prompts: list[list[int]]):
    from pdserve import LLM

    llm = LLM(
        model=model, dtype="float32", device=device.type, num_threads=1, num_kv_blocks=64,
        max_model_len=256, gpu_memory_utilization=0.2, tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
        return [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def compare(whole, split, tolerance: float) -> list[tuple[int, bool, float]]:
    """Per prompt: (tokens, same tokens and top-5 ids, max |logprob difference|)."""
    rows = []
    for a, b in zip(whole, split, strict=True):
        same = a.token_ids == b.token_ids and len(a.token_ids) > 0
        diff = 0.0
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            same = same and x.top_ids == y.top_ids
            diff = max(
                [diff, *(abs(u - v) for u, v in zip(x.top_logprobs, y.top_logprobs, strict=True))]
            )
        rows.append((len(a.token_ids), same and diff <= tolerance, diff))
    return rows


def run_split(device: torch.device, dry_run: bool, tp: int, pp: int) -> Outcome:
    refused = two_rank_refusal(device)
    if refused:
        raise SectionSkipped(refused)
    cfg = model_shape(dry_run)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 40, 100] if dry_run else [5, 40, 200]
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        model = write_checkpoint(Path(tmp) / "model", cfg)
        whole = greedy(model, device, 1, 1, prompts)
        split = greedy(model, device, tp, pp, prompts)
    tolerance = 1e-4 if device.type == "cpu" else 1e-3
    rows = compare(whole, split, tolerance)
    print(f"pdserve.LLM at TP={tp} PP={pp} against TP=1 PP=1 on {device.type}, fp32, greedy:")
    print(f"  {'prompt':>6} {'tokens':>6} {'equal':>5} {'max |logprob diff|':>18}")
    for length, (tokens, same, diff) in zip(lengths, rows, strict=True):
        print(f"  {length:>6} {tokens:>6} {'yes' if same else 'NO':>5} {diff:>18.2e}")
    off = [str(n) for n, (_, same, _) in zip(lengths, rows, strict=True) if not same]
    if off:
        return Outcome.failed(f"prompts of {', '.join(off)} tokens differ (tolerance {tolerance})")
    return Outcome.ok()


def run_tp_section(device: torch.device, dry_run: bool) -> Outcome:
    return run_split(device, dry_run, tp=2, pp=1)


def run_pp_section(device: torch.device, dry_run: bool) -> Outcome:
    return run_split(device, dry_run, tp=1, pp=2)
