"""Benchmark datasets: what each request sends and how many tokens it asks for.

- `random`: prompts of random words (or random token ids when the server tokenizes,
  which makes their lengths exact), lengths drawn uniformly within a range ratio.
- `sharegpt`: ShareGPT-format conversations (a JSON list or JSONL); the first human
  turn is the prompt and the reply's length is the output length.
- `jsonl`: one recorded request per line, `{"prompt": ..., "output_len": N}` with an
  optional `"timestamp"` in seconds for replaying the original arrival times.
- `rag`: long prompts of shared document chunks plus a question (see `pdserve.bench.rag`).
- `prefix_repetition`: vLLM's dataset of the same name: `num_prefixes` random prefixes
  of `prefix_len` tokens, each request one of them plus its own random suffix of
  `suffix_len` tokens, asking for `output_len` tokens; requests shuffled.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.tokenizer import ApproximateTokenizer, Tokenizer
from pdserve.bench.words import WORDS

DATASET_NAMES = ("random", "sharegpt", "jsonl", "rag", "prefix_repetition")


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    # Seconds from the start of a replayed log; None lets the arrival process decide.
    timestamp: float | None = None


@dataclass
class DatasetSpec:
    name: str = "random"
    path: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    sharegpt_output_len: int | None = None
    rag_num_documents: int = 8
    rag_chunk_len: int = 256
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    seed: int = 0
    # Synthetic prompts as words even when the tokenizer is exact (chat sends text).
    text_prompts: bool = False


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    """Integer lengths uniform in [mean*(1-r), mean*(1+r)], at least 1."""
    if mean < 1:
        raise ValueError(f"lengths must be at least 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(round(mean * (1 - range_ratio))))
    high = max(low, int(round(mean * (1 + range_ratio))))
    return rng.integers(low, high + 1, size=n)


def random_text(rng: np.random.Generator, num_words: int) -> str:
    return " ".join(rng.choice(WORDS, size=num_words))


def vocabulary_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Token ids the server really uses, to draw random prompts from."""
    return np.unique(np.asarray(tokenizer.encode(" ".join(WORDS)), dtype=np.int64))


def random_samples(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    rng = np.random.default_rng(spec.seed)
    input_lens = sample_lengths(
        rng, spec.random_input_len, spec.random_range_ratio, spec.num_prompts
    )
    output_lens = sample_lengths(
        rng, spec.random_output_len, spec.random_range_ratio, spec.num_prompts
    )
    samples = []
    pool = vocabulary_ids(tokenizer) if tokenizer.exact and not spec.text_prompts else None
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        if pool is not None:
            prompt: str | list[int] = [int(t) for t in rng.choice(pool, size=int(in_len))]
            prompt_len = int(in_len)
        else:
            # One approximate token per word: the count is exact for this tokenizer.
            prompt = random_text(rng, int(in_len))
            prompt_len = tokenizer.count(prompt)
        samples.append(SampleRequest(prompt, prompt_len, int(out_len)))
    return samples


def prefix_repetition_samples(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    rng = np.random.default_rng(spec.seed)
    prefix_len, suffix_len = spec.prefix_repetition_prefix_len, spec.prefix_repetition_suffix_len
    if spec.prefix_repetition_num_prefixes < 1 or prefix_len < 0 or suffix_len < 0:
        raise ValueError("prefix repetition needs at least 1 prefix and non-negative lengths")
    pool = vocabulary_ids(tokenizer) if tokenizer.exact and not spec.text_prompts else None

    def piece(length: int) -> str | list[int]:
        if pool is not None:
            return [int(t) for t in rng.choice(pool, size=length)]
        return random_text(rng, length)

    prefixes = [piece(prefix_len) for _ in range(spec.prefix_repetition_num_prefixes)]
    samples = []
    for index in range(spec.num_prompts):
        prefix, suffix = prefixes[index % len(prefixes)], piece(suffix_len)
        if isinstance(prefix, list) and isinstance(suffix, list):
            prompt: str | list[int] = prefix + suffix
            prompt_len = len(prompt)
        else:
            prompt = " ".join(p for p in (str(prefix), str(suffix)) if p)
            prompt_len = tokenizer.count(prompt)
        samples.append(SampleRequest(prompt, prompt_len, spec.prefix_repetition_output_len))
    # Shuffled, as vLLM does, so that repeats of one prefix do not arrive back to back.
    order = rng.permutation(len(samples))
    return [samples[i] for i in order]


def read_records(path: str) -> list:
    """A JSON list, or one JSON value per line."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            records = json.loads(stripped)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON or JSONL ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list or JSONL records")
    return records


def sharegpt_samples(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    records = [
        r
        for r in read_records(require_path(spec))
        if isinstance(r, dict) and len(r.get("conversations", [])) >= 2
    ]
    random.Random(spec.seed).shuffle(records)
    samples: list[SampleRequest] = []
    for record in records:
        if len(samples) == spec.num_prompts:
            break
        first, reply = record["conversations"][0], record["conversations"][1]
        prompt, completion = str(first.get("value", "")), str(reply.get("value", ""))
        prompt_len = tokenizer.count(prompt)
        output_len = spec.sharegpt_output_len or tokenizer.count(completion)
        # Like vLLM: drop degenerate pairs that would skew the lengths.
        if prompt_len < 4 or output_len < 4:
            continue
        samples.append(SampleRequest(prompt, prompt_len, output_len))
    if not samples:
        raise ValueError(f"{spec.path}: no usable ShareGPT conversations")
    return samples


def jsonl_samples(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    samples = []
    for number, record in enumerate(read_records(require_path(spec)), start=1):
        samples.append(replay_sample(record, number, spec.path or "", tokenizer))
        if len(samples) == spec.num_prompts:
            break
    if not samples:
        raise ValueError(f"{spec.path}: no requests")
    return samples


def replay_sample(record: object, number: int, path: str, tokenizer: Tokenizer) -> SampleRequest:
    where = f"{path}: record {number}"
    if not isinstance(record, dict) or "prompt" not in record:
        raise ValueError(f"{where} needs a 'prompt'")
    prompt = record["prompt"]
    output_len = record.get("output_len", record.get("max_tokens"))
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"{where} needs a positive integer 'output_len' (or 'max_tokens')")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        prompt_len = len(prompt)
    elif isinstance(prompt, str):
        prompt_len = tokenizer.count(prompt)
    else:
        raise ValueError(f"{where}: 'prompt' must be a string or a list of token ids")
    timestamp = record.get("timestamp")
    if timestamp is not None and not isinstance(timestamp, int | float):
        raise ValueError(f"{where}: 'timestamp' must be a number of seconds")
    return SampleRequest(prompt, prompt_len, output_len, timestamp)


def require_path(spec: DatasetSpec) -> str:
    if not spec.path:
        raise ValueError(f"dataset '{spec.name}' needs --dataset-path")
    if not Path(spec.path).is_file():
        raise ValueError(f"dataset file not found: {spec.path}")
    return spec.path


def build_samples(spec: DatasetSpec, tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
    """The requests of a run, deterministic for a given spec and tokenizer."""
    from pdserve.bench.rag import rag_samples

    if spec.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {spec.num_prompts}")
    tokenizer = tokenizer or ApproximateTokenizer()
    builders = {
        "random": random_samples,
        "sharegpt": sharegpt_samples,
        "jsonl": jsonl_samples,
        "rag": rag_samples,
        "prefix_repetition": prefix_repetition_samples,
    }
    if spec.name not in builders:
        raise ValueError(f"unknown dataset '{spec.name}': choose {', '.join(DATASET_NAMES)}")
    samples = builders[spec.name](spec, tokenizer)
    if spec.text_prompts and any(not isinstance(s.prompt, str) for s in samples):
        raise ValueError(
            f"dataset '{spec.name}' made token-id prompts, which a chat request cannot carry: "
            "use --token-counting approximate"
        )
    return samples
