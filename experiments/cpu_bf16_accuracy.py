"""How far a bf16 model's outputs move when the CPU linear layer rounds activations to
bf16 (bf16 dot products) instead of multiplying float32 activations.

    python -m experiments.cpu_bf16_accuracy [--prompts 12] [--tokens 20]

The reference is transformers in float32 on the checkpoint's weights rounded to bf16
(the model a bf16 checkpoint describes, computed exactly in float32). Against it, each
of pdserve's two C paths (float32 x; bf16 x, on CPUs with AVX512-BF16) and
transformers computing in bf16: how many prompts give the reference's greedy tokens
(all of them: transformers stops at end-of-text, pdserve runs on to --tokens), and the
|difference| of the chosen tokens' logprobs over the prefix that agrees.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from experiments.hf_greedy import greedy_generate
from pdserve import LLM, SamplingParams
from pdserve.engine.embedded import embedded_model_path
from pdserve.kernels import dispatch

# Chat questions, shared with the embedded model's generation tests.
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three primary colors.",
    "What is 17 times 3?",
    "Give me a synonym for happy.",
    "How do airplanes fly?",
    "Translate 'good morning' into Spanish.",
    "What is photosynthesis?",
    "Name a famous painting by Leonardo da Vinci.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "What are the planets of the solar system?",
    "Describe a cat in one sentence.",
    "What is the boiling point of water?",
    "Suggest a name for a pet goldfish.",
    "What does a CPU do?",
    "Tell me a fun fact about octopuses.",
    "How many days are in a leap year?",
    "What is the opposite of cold?",
    "Summarize the story of Cinderella.",
    "What is machine learning?",
]
Run = list[tuple[list[int], list[float]]]  # per prompt: greedy tokens, their logprobs


def pdserve_run(llm: LLM, prompts: list[list[int]], tokens: int, dot: bool) -> Run:
    kernels = dispatch.lookup("linear", torch.zeros(1, 4)).__self__
    kernels.bf16_dot = dot
    params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def transformers_run(model, prompts: list[list[int]], tokens: int) -> Run:
    result = []
    for p in prompts:
        out = greedy_generate(model, p, tokens, output_scores=True, return_dict_in_generate=True)
        ids = out.sequences[0, len(p) :].tolist()
        scores = zip(out.scores, ids, strict=True)
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in scores]
        result.append((ids, logprobs))
    return result


def compare(name: str, ref: Run, got: Run) -> str:
    agreed, means, maxes = [], [], []
    for (ref_ids, ref_lps), (ids, lps) in zip(ref, got, strict=True):
        pairs = enumerate(zip(ref_ids, ids, strict=False))
        n = next((i for i, (a, b) in pairs if a != b), min(len(ref_ids), len(ids)))
        agreed.append(n)
        diffs = [abs(a - b) for a, b in zip(ref_lps[:n], lps[:n], strict=True)]
        if diffs:
            means.append(statistics.mean(diffs))
            maxes.append(max(diffs))
    whole = sum(n == len(ref_ids) for n, (ref_ids, _) in zip(agreed, ref, strict=True))
    return (
        f"{name:22s} same greedy tokens {whole}/{len(ref)}, shortest agreeing prefix "
        f"{min(agreed)}; |dlogprob| mean {statistics.mean(means):.4f} max {max(maxes):.4f}"
    )


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=20)
    args = parser.parse_args(argv)
    folder = str(embedded_model_path())
    llm = LLM(dtype="bfloat16", kv_cache_memory=256 << 20, max_model_len=1024)
    tok = llm.get_tokenizer()
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False
        )
        for q in QUESTIONS[: args.prompts]
    ]
    exact = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for param in exact.parameters():
        param.data = param.data.bfloat16().float()
    ref = transformers_run(exact, prompts, args.tokens)
    narrow = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    runs = {"pdserve float32 x": pdserve_run(llm, prompts, args.tokens, dot=False)}
    if dispatch.lookup("linear", torch.zeros(1, 4)).__self__.bf16_dot_available:
        runs["pdserve bf16 x (dot)"] = pdserve_run(llm, prompts, args.tokens, dot=True)
    runs["transformers bf16"] = transformers_run(narrow, prompts, args.tokens)
    for name, got in runs.items():
        print(compare(name, ref, got))


if __name__ == "__main__":
    main()
