"""Step-time models measured through a running server, as `bench serve` sees them.

The offline calibration (`pdserve.planner.sim.calibration`) times the engine alone, with the
threads and token budget it is given. A served step costs what that engine step costs
with the instance's own thread share, plus what the serving path adds: the front end
(HTTP, routing, ZMQ both ways, detokenization, SSE) on the first token, and in a
disaggregated deployment the handoff (message, allocation on the decode side, KV pull)
before the second. This module measures all of it over HTTP with the benchmark's own
client, and fits the same models:

- prefill: single requests (concurrency 1) of several prompt lengths, each within one
  chunked-prefill budget, with four output tokens. TTFT is one prefill step of that
  prompt plus the front end's fixed cost, which the fitted intercept carries. Their
  last gaps are decode steps of batch 1 at those prompts' lengths (colocated, the first
  gap is one as well): contexts that vary, so the fit can tell the cost of attention
  from the cost of a sequence.
- decode: B requests per decode instance (the gateway spreads them evenly) sent at
  once with answers of `decode_output_len` tokens. Each request's mean gap between
  tokens, first gaps left out, is one decode step of batch B whose contexts average the
  prompt plus half the answer; the probe takes the median over its requests. A mean
  within a request, not a median of gaps, because a stall in delivery (a busy client or
  server thread) bunches tokens without changing their sum: short gaps after a long one.
- handoff (disaggregated): the first gap of each single prefill request less one
  decode step of batch 1 is the time from the prefill step's end to the KV being ready
  on an idle decode instance; fitted as a fixed cost plus a cost per prompt token.

The result is the calibration JSON that `pdserve.planner.sim.latency` reads, with the handoff
fit and the raw probe figures beside it.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

import numpy as np

from pdserve.bench.datasets import DatasetSpec, build_samples
from pdserve.bench.runner import RunConfig, run_benchmark
from pdserve.bench.tokenizer import ServerTokenizer
from pdserve.planner.sim.latency import StepSample, calibration_from_measurements, fit_latency_model
from pdserve.planner.sim.latency import prefill_pairs as pairs_of

# Decode gaps before this index are left out: a request's first gaps may fall in steps
# the rest of its batch has not joined yet (handoffs arrive one step apart).
FIRST_STEADY_GAP = 2
PREFILL_PROBE_TOKENS = 4  # the first token, the handoff's gap, two decode steps alone


@dataclass(frozen=True)
class ProbePlan:
    prefill_lens: tuple[int, ...] = (32, 128, 256, 448)
    prefill_repeats: int = 3
    decode_batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_prompt_len: int = 64
    decode_output_len: int = 24
    decode_instances: int = 1  # requests of a decode probe = batch x this
    disaggregated: bool = True
    seed: int = 1000  # fresh prompts: no probe reuses another's prefix cache

    def validate(self, max_num_batched_tokens: int) -> None:
        if max(self.prefill_lens) > max_num_batched_tokens:
            raise ValueError(
                f"prefill probes must fit one step: {max(self.prefill_lens)} tokens > "
                f"the budget of {max_num_batched_tokens}"
            )
        if self.decode_output_len <= FIRST_STEADY_GAP + 2:
            raise ValueError(f"decode probes need more than {FIRST_STEADY_GAP + 2} tokens")
        if self.prefill_repeats < 1 or not self.decode_batches:
            raise ValueError("probe counts must be at least 1")


async def run_probe(
    base_url: str, tokenizer: ServerTokenizer, spec: DatasetSpec, concurrency: int
) -> dict:
    """One `bench serve` run of exact-length token-id prompts run to their max_tokens."""
    samples = build_samples(spec, tokenizer)
    config = RunConfig(
        base_url=base_url, max_concurrency=concurrency, ignore_eos=True, show_progress=False
    )
    result = await run_benchmark(samples, config)
    if result["failed"]:
        errors = sorted({e for e in result["errors"] if e})
        raise RuntimeError(f"calibration probe failed: {'; '.join(errors[:3])}")
    return result


async def probe_prefill(base_url: str, tokenizer: ServerTokenizer, plan: ProbePlan) -> list[dict]:
    """(prompt length, TTFT, first gap) of single requests, one at a time."""
    records = []
    for index, length in enumerate(plan.prefill_lens):
        spec = DatasetSpec(
            num_prompts=plan.prefill_repeats,
            random_input_len=length,
            random_output_len=PREFILL_PROBE_TOKENS,
            seed=plan.seed + index,
        )
        result = await run_probe(base_url, tokenizer, spec, concurrency=1)
        for prompt_len, ttft, gaps in zip(
            result["input_lens"], result["ttfts"], result["itls"], strict=True
        ):
            records.append(
                {
                    "prompt_len": prompt_len,
                    "ttft_s": ttft,
                    "first_gap_s": gaps[0],
                    "decode_gap_s": float(np.median(gaps[1:])),
                }
            )
    return records


def steady_step_s(itls: list[list[float]]) -> float:
    """One decode step from requests' gaps: the median over requests of their mean steady gap."""
    return float(np.median([np.mean(gaps[FIRST_STEADY_GAP:]) for gaps in itls]))


async def probe_decode(base_url: str, tokenizer: ServerTokenizer, plan: ProbePlan) -> list[dict]:
    """(batch, mean context, steady step time) per batch size."""
    records = []
    for index, batch in enumerate(plan.decode_batches):
        count = batch * plan.decode_instances
        spec = DatasetSpec(
            num_prompts=count,
            random_input_len=plan.decode_prompt_len,
            random_output_len=plan.decode_output_len,
            seed=plan.seed + 100 + index,
        )
        result = await run_probe(base_url, tokenizer, spec, concurrency=count)
        gaps = [g for request in result["itls"] for g in request[FIRST_STEADY_GAP:]]
        mean_context = plan.decode_prompt_len + (FIRST_STEADY_GAP + plan.decode_output_len) / 2
        records.append(
            {
                "batch": batch,
                "mean_context": mean_context,
                "step_s": steady_step_s(result["itls"]),
                "p90_gap_s": float(np.percentile(gaps, 90)),
            }
        )
    return records


def fit_from_probes(prefill: list[dict], decode: list[dict], plan: ProbePlan) -> dict:
    """The calibration JSON from probe records (see the module docstring)."""
    prefill_samples = [
        {
            "batch_tokens": r["prompt_len"],
            "attention_pairs": pairs_of(r["prompt_len"]),
            "seconds": r["ttft_s"],
        }
        for r in prefill
    ]
    decode_samples = [
        {
            "batch_tokens": r["batch"],
            "attention_pairs": int(round(r["batch"] * r["mean_context"])),
            "seconds": r["step_s"],
        }
        for r in decode
    ]
    decode_samples += [
        {"batch_tokens": 1, "attention_pairs": r["prompt_len"] + 2, "seconds": r["decode_gap_s"]}
        for r in prefill
    ]
    if not plan.disaggregated:
        # A colocated instance's first gap is a decode step of batch 1 as well.
        decode_samples += [
            {"batch_tokens": 1, "attention_pairs": r["prompt_len"] + 1, "seconds": r["first_gap_s"]}
            for r in prefill
        ]
    data = {"source": "server", "tp": 1, "prefill": prefill_samples, "decode": decode_samples}
    calibration = calibration_from_measurements(data)
    handoff = {"base_s": 0.0, "per_token_s": 0.0}
    if plan.disaggregated:
        samples = [
            StepSample(
                r["prompt_len"],
                0,
                max(0.0, r["first_gap_s"] - calibration.decode.predict(1, r["prompt_len"] + 1)),
            )
            for r in prefill
        ]
        model = fit_latency_model(samples)
        handoff = {"base_s": model.intercept_s, "per_token_s": model.per_token_s}
    data["handoff"] = handoff
    data["fitted"] = calibration.to_json()
    data["probes"] = {"plan": asdict(plan), "prefill": prefill, "decode": decode}
    return data


async def calibrate_server(base_url: str, plan: ProbePlan, max_num_batched_tokens: int) -> dict:
    """Probe a running server and fit its step models (see the module docstring)."""
    plan.validate(max_num_batched_tokens)
    tokenizer = ServerTokenizer(base_url, None)
    try:
        prefill = await probe_prefill(base_url, tokenizer, plan)
        decode = await probe_decode(base_url, tokenizer, plan)
    finally:
        tokenizer.close()
    return fit_from_probes(prefill, decode, plan)


def calibrate_server_sync(base_url: str, plan: ProbePlan, max_num_batched_tokens: int) -> dict:
    return asyncio.run(calibrate_server(base_url, plan, max_num_batched_tokens))
