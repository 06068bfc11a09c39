"""Where a CPU decode step's time goes: the offline engine's `EngineCore.step` split by
op and by stage.

    python -m experiments.decode_step_cost [--batches 1 32] [--steps 40] [--rounds 3]
        [--threads 1 --clock cpu] [--dtype float32 --quantization int8] [--prefill 2000]
        [--untimed [--enforce-eager]]

Each batch runs `batch` greedy requests of random 128-token prompts through the
prefill, then times `--steps` decode steps, `--rounds` times (the median round is
printed). `--prefill N` then times, the same way, the steps that compute one fresh
N-token prompt up to its first token (one step where N fits the step's token budget),
a new random prompt each round so the prefix cache never serves it. The ops the model
calls (linear, rms_norm, rotary, the KV write, attention, the LM head) are wrapped in
timers for the timed steps, so "model glue" is the
forward's wall time outside them (Python, module calls, splits and views, the MLP's
activation) and "step driver" is `EngineCore.step` outside the rank's prepare /
forward / sample (the scheduler, the plan, the deltas). A timer costs ~0.2 us a call
on the wall clock, ~1 us on the CPU clock (a system call), ~300 calls a step.
`--clock cpu` counts this thread's CPU time: with `--threads 1` every op runs on it,
and time the core spent on other processes of a busy machine drops out.
The timed breakdown runs the eager forward (a decode step recorded as one C call,
`engine/cpu_decode.py`, calls none of the timed ops); `--untimed` times the steps as
the engine runs them, recorded unless `--enforce-eager`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.models import int8, llama, packed
from pdserve.engine.runner import ModelRunner
from pdserve.engine.worker import ModelWorker
from pdserve.kernels import attention

Clock = dict[str, float]

# (module, attribute, label), in print order: what gets a timer, where the model has
# it (the unfused and fused attention ops). Indented labels are parts of the op above.
MODEL_OPS = [
    (int8, "linear", "linear (C)"),  # every decoder-layer projection goes through int8.project
    (int8, "linear_int8", "linear int8 (C)"),
    (packed, "linear_gguf", "linear GGUF blocks (C)"),  # a GGUF file's packed matrices
    (llama, "rms_norm", "rms_norm (+residual)"),
    (llama, "rotary_embedding", "rotary"),
    (llama, "rotary_write_kv_cache", "rotary + KV write"),
    (llama, "paged_attention", "attention"),
    (attention, "write_kv_cache", "  of which KV write"),
    (llama, "attend_cached", "attention (cache written)"),
    (attention, "decode_attention", "  of which decode attention"),
]
STAGES = [
    (ModelRunner, "prepare", "step inputs (prepare)"),
    (ModelRunner, "execute", "forward + logits"),
    (ModelWorker, "sample", "sampling"),
    (ModelWorker, "_update_requests", "rank request mirrors"),
]


# perf_counter (wall) or thread_time (this thread's CPU time: on a loaded machine with
# --threads 1 it leaves out the time other processes held the core).
now = time.perf_counter


def timer(clock: Clock, label: str, fn: Callable) -> Callable:
    def timed(*args, **kwargs):
        start = now()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[label] += now() - start

    return timed


@contextlib.contextmanager
def timers(clock: Clock, compute_logits_owner) -> Iterator[None]:
    """Every op and stage wrapped in a timer into `clock` while inside."""
    saved = []
    targets = [t for t in MODEL_OPS if hasattr(t[0], t[1])] + STAGES
    for owner, name, label in targets:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, timer(clock, label, original))
    head = compute_logits_owner.compute_logits
    compute_logits_owner.compute_logits = timer(clock, "LM head (C linear)", head)
    try:
        yield
    finally:
        del compute_logits_owner.compute_logits
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def start_requests(llm: LLM, batch: int, prompt_len: int, steps: int) -> None:
    vocab = llm.engine.vocab_size
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i, prompt in enumerate(torch.randint(3, vocab, (batch, prompt_len), generator=gen)):
        llm.engine.add_request(llm.engine.make_request(f"b{batch}-{i}", prompt.tolist(), params))
    while any(r.num_output_tokens == 0 for r in llm.engine.scheduler.running):
        llm.engine.step()


def one_round(llm: LLM, steps: int) -> Clock:
    clock: Clock = defaultdict(float)
    model = llm.engine.executor.worker.model
    with timers(clock, model):
        for _ in range(steps):
            step_start = now()
            llm.engine.step()
            clock["step"] += now() - step_start
    return {k: v / steps * 1e3 for k, v in clock.items()}


def prefill_round(llm: LLM, prompt_len: int, seed: int) -> Clock:
    """ms of each op over the steps that take one fresh prompt to its first token."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, llm.engine.vocab_size, (prompt_len,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = llm.engine.make_request(f"prefill-{seed}", prompt, params)
    llm.engine.add_request(request)
    clock: Clock = defaultdict(float)
    with timers(clock, llm.engine.executor.worker.model):
        while request.num_output_tokens == 0:
            step_start = now()
            llm.engine.step()
            clock["step"] += now() - step_start
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return {k: v * 1e3 for k, v in clock.items()}


def print_median(rounds: list[Clock]) -> None:
    rows = [breakdown(r) for r in rounds]
    for i, (label, _) in enumerate(rows[0]):
        print(f"  {label:<40} {statistics.median(r[i][1] for r in rows):8.2f}")


def breakdown(clock: Clock) -> list[tuple[str, float]]:
    ops = [label for _, _, label in MODEL_OPS if label in clock]
    top_ops = [label for label in ops if not label.startswith("  ")]
    head = clock["LM head (C linear)"]
    model_ops = sum(clock[label] for label in top_ops) + head
    rows = [(label, clock[label]) for label in ops]
    rows.append(("LM head (C linear)", head))
    rows.append(("model glue (Python, torch views)", clock["forward + logits"] - model_ops))
    rows.append(("forward + logits", clock["forward + logits"]))
    for label in ("step inputs (prepare)", "sampling", "rank request mirrors"):
        rows.append((label, clock[label]))
    rank = sum(
        clock[k]
        for k in ("step inputs (prepare)", "forward + logits", "sampling", "rank request mirrors")
    )
    rows.append(("step driver (scheduler, plan, deltas)", clock["step"] - rank))
    rows.append(("EngineCore.step", clock["step"]))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="checkpoint folder or GGUF file (default: embedded)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="int8: the layers' matrices in int8")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument(
        "--untimed",
        action="store_true",
        help="step wall time only, no timers; decode batches of up to 8 then run as one C "
        "call each (engine/cpu_decode.py) unless --enforce-eager",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no recorded decode steps")
    parser.add_argument("--prefill", type=int, default=0, help="also time an N-token prompt")
    args = parser.parse_args(argv)
    global now
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    llm = LLM(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        num_threads=args.threads, max_num_seqs=256,
        # The timers wrap the ops the eager forward calls: a recorded step calls none.
        enforce_eager=args.enforce_eager or not args.untimed,
    )  # fmt: skip
    print(
        f"dtype {args.dtype}, quantization {args.quantization}, weights "
        f"{llm.engine.info.weight_bytes / 2**20:.0f} MiB, {torch.get_num_threads()} threads, "
        f"{args.clock} clock, {llm.engine.info.kernels}, "
        f"{'eager' if llm.engine.config.enforce_eager else 'recorded'} decode steps"
    )
    for batch in args.batches:
        start_requests(llm, batch, args.prompt_len, args.steps)
        one_round(llm, 3)  # warm
        if args.untimed:
            walls = []
            for _ in range(args.rounds):
                start = now()
                for _ in range(args.steps):
                    llm.engine.step()
                walls.append((now() - start) / args.steps * 1e3)
            print(f"batch {batch}: step ms per round {[round(w, 2) for w in walls]}")
        else:
            rounds = [one_round(llm, args.steps) for _ in range(args.rounds)]
            print(f"batch {batch}: ms per decode step, median of {args.rounds} rounds")
            print_median(rounds)
        for request in list(llm.engine.scheduler.running):
            llm.engine.abort_request(request.request_id)
        llm.engine.step()
    if args.prefill:
        prefill_round(llm, args.prefill, seed=0)  # warm
        rounds = [prefill_round(llm, args.prefill, seed=1 + i) for i in range(args.rounds)]
        print(f"prefill of {args.prefill} tokens: ms to the first token, median of {args.rounds}")
        print_median(rounds)


if __name__ == "__main__":
    main()
