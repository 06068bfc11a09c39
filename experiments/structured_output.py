"""What a structured-output constraint costs per decode step, and a grammar's first compile.

    python -m experiments.structured_output [--batch 8] [--tokens 48] [--runs 3]

The embedded model generates the same batch (sampling at temperature 0.8, seeded) free and
under a constraint that cannot complete within the tokens asked for (a regex of 200 words,
so both runs generate exactly as many tokens); the medians of the per-token times of
several runs are compared in one process (the machine is noisy: quote the ratio). A cold
grammar's time to the first token includes importing xgrammar and reading the vocabulary
once per process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdserve import LLM, SamplingParams
from pdserve.common.structured_output import StructuredOutput

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}  # fmt: skip


def per_token_ms(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> float:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return 1000 * (time.perf_counter() - started) / max(1, tokens) * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(num_threads=2, kv_cache_memory=256 << 20, max_model_len=1024)
    prompts = [f"List {i + 2} people with their ages as JSON:" for i in range(args.batch)]
    spec = StructuredOutput(regex="([a-z]+ ){200}")
    schema = StructuredOutput(json=json.dumps(SCHEMA))

    def params(structured: StructuredOutput | None) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.8, seed=i, max_tokens=args.tokens,
                               ignore_eos=True, structured_outputs=structured)
                for i in range(args.batch)]  # fmt: skip

    started = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, structured_outputs=schema))
    cold = time.perf_counter() - started
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, structured_outputs=spec))
    free, constrained = [], []
    for _ in range(args.runs):  # interleaved, so drift hits both alike
        free.append(per_token_ms(llm, prompts, params(None)))
        constrained.append(per_token_ms(llm, prompts, params(spec)))
    free_ms, constrained_ms = statistics.median(free), statistics.median(constrained)
    print(f"batch {args.batch}, {args.tokens} tokens each, {args.runs} runs, embedded model")
    print("| | per decode step (ms, median) |")
    print("|---|---|")
    print(f"| free | {free_ms:.1f} |")
    print(f"| regex, 200 words | {constrained_ms:.1f} |")
    print(
        f"constrained / free: {constrained_ms / free_ms:.2f}; a JSON schema's first request "
        f"in a fresh process (xgrammar import, vocabulary, compile): {cold:.2f} s"
    )


if __name__ == "__main__":
    main()
