"""Measuring step times of our own engine through the public `pdserve` API.

Only `LLM.generate` is used, so the figures include everything a step costs in
practice (scheduling, sampling, detokenization):

- prefill: a batch of B prompts of L tokens with one output token; its time is the
  prefill of B*L tokens (several steps when B*L exceeds the engine's token budget,
  which the fit then folds into its per-token cost).
- decode: the same shape with 1 + N output tokens; the extra time over the prefill run,
  divided by N, is one decode step of batch B whose contexts average L + N/2.

Prompts are random token ids, fresh for every run, so the prefix cache never helps.
The result is the calibration JSON that `pdserve.planner.sim.latency` fits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from pdserve.planner.sim.latency import prefill_pairs

# Ids low enough to exist in every vocabulary, past the usual special tokens.
TOKEN_ID_RANGE = (100, 1000)


class CalibrationUnavailable(RuntimeError):
    """The pdserve engine cannot be loaded here."""


def load_engine(model: str | None, dtype: str, engine_args: dict):
    try:
        from pdserve import LLM, SamplingParams
    except ImportError as exc:
        raise CalibrationUnavailable(
            f"the pdserve engine is not available (from pdserve import LLM failed: {exc})"
        ) from None
    try:
        return LLM(model=model, dtype=dtype, **engine_args), SamplingParams
    except Exception as exc:  # the engine's own errors are not ours to enumerate
        raise CalibrationUnavailable(f"could not start the pdserve engine: {exc}") from None


def random_prompts(rng: np.random.Generator, batch: int, length: int) -> list[list[int]]:
    low, high = TOKEN_ID_RANGE
    return [[int(t) for t in rng.integers(low, high, size=length)] for _ in range(batch)]


def timed_generate(llm, sampling_params_cls, prompts: list[list[int]], max_tokens: int) -> float:
    params = sampling_params_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    produced = [len(o.token_ids) for o in outputs]
    if produced != [max_tokens] * len(prompts):
        raise CalibrationUnavailable(
            f"the engine produced {produced} tokens where {max_tokens} each were asked"
        )
    return elapsed


def collect_step_samples(
    model: str | None = None,
    dtype: str = "bfloat16",
    prompt_lens: Sequence[int] = (64, 256, 1024),
    batch_sizes: Sequence[int] = (1, 4, 16),
    decode_tokens: int = 32,
    repeats: int = 2,
    seed: int = 0,
    tp: int = 1,
    **engine_args,
) -> dict:
    """Measure prefill and decode step times; returns the calibration JSON object."""
    if decode_tokens < 2:
        raise ValueError("decode_tokens must be at least 2")
    llm, sampling_params_cls = load_engine(model, dtype, dict(engine_args))
    rng = np.random.default_rng(seed)
    timed_generate(llm, sampling_params_cls, random_prompts(rng, 1, 16), 2)  # warm-up
    prefill, decode = [], []
    for length in prompt_lens:
        for batch in batch_sizes:
            for _ in range(repeats):
                first = timed_generate(
                    llm, sampling_params_cls, random_prompts(rng, batch, length), 1
                )
                longer = timed_generate(
                    llm, sampling_params_cls, random_prompts(rng, batch, length), 1 + decode_tokens
                )
                prefill.append(
                    {
                        "batch_tokens": batch * length,
                        "attention_pairs": batch * prefill_pairs(length),
                        "seconds": first,
                    }
                )
                decode.append(
                    {
                        "batch_tokens": batch,
                        "attention_pairs": batch * (length + decode_tokens // 2),
                        "seconds": max(0.0, longer - first) / decode_tokens,
                    }
                )
    return {"model": model, "dtype": dtype, "tp": tp, "prefill": prefill, "decode": decode}
