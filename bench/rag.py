"""A retrieval-augmented-generation workload: long prompts with repeating prefixes.

A fixed pool of documents, each a sequence of chunks, stands for a retrieval corpus.
Every request takes the leading chunks of one document (popular documents are picked
more often, with Zipf-like weights) and ends with a question of its own, so whole
chunks repeat across requests as prefixes do in RAG, and the prefix cache matters.
Prompt lengths follow `random_input_len` and `random_range_ratio`; with a server
tokenizer the prompts are token ids of exactly that length.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from pdserve.bench.datasets import DatasetSpec, SampleRequest, random_text, sample_lengths
from pdserve.bench.tokenizer import Tokenizer

# The question is never shorter than this (or a quarter of the prompt, if shorter).
MIN_QUESTION_TOKENS = 16


class RagCorpus:
    """Documents of fixed-size chunks, as token ids (exact) or text (approximate)."""

    def __init__(self, spec: DatasetSpec, tokenizer: Tokenizer, max_prompt_len: int) -> None:
        if spec.rag_num_documents < 1 or spec.rag_chunk_len < 1:
            raise ValueError("RAG documents and chunk length must be at least 1")
        self.chunk_len = spec.rag_chunk_len
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(spec.seed)
        chunks_per_document = math.ceil(max_prompt_len / self.chunk_len)
        self.documents = [
            [self.make_chunk(self.chunk_len) for _ in range(chunks_per_document)]
            for _ in range(spec.rag_num_documents)
        ]
        ranks = np.arange(1, spec.rag_num_documents + 1, dtype=float)
        self.popularity = (1.0 / ranks) / (1.0 / ranks).sum()

    def make_chunk(self, num_tokens: int) -> str | list[int]:
        """A text of `num_tokens` approximate tokens, or exactly that many token ids."""
        text = random_text(self.rng, num_tokens)
        if not self.tokenizer.exact:
            return text
        # Every word is at least one token, so cutting never leaves the chunk short.
        return self.tokenizer.encode(text)[:num_tokens]

    def make_question(self, num_tokens: int) -> str | list[int]:
        if not self.tokenizer.exact:
            return "Question: " + random_text(self.rng, max(1, num_tokens - 3)) + " ?"
        ids = self.tokenizer.encode("Question: " + random_text(self.rng, num_tokens))
        return ids[:num_tokens]

    def make_prompt(self, prompt_len: int) -> SampleRequest:
        question_len = min(MIN_QUESTION_TOKENS, max(1, prompt_len // 4))
        num_chunks = max(0, (prompt_len - question_len) // self.chunk_len)
        question_len = prompt_len - num_chunks * self.chunk_len
        document = self.documents[self.rng.choice(len(self.documents), p=self.popularity)]
        chunks = document[:num_chunks]
        question = self.make_question(question_len)
        if self.tokenizer.exact:  # chunks and question are token ids
            ids = [t for chunk in cast(list[list[int]], chunks) for t in chunk]
            ids += cast(list[int], question)
            return SampleRequest(ids, len(ids), 0)
        text = "\n\n".join([*cast(list[str], chunks), str(question)])
        return SampleRequest(text, self.tokenizer.count(text), 0)


def rag_samples(spec: DatasetSpec, tokenizer: Tokenizer) -> list[SampleRequest]:
    rng = np.random.default_rng(spec.seed + 1)
    prompt_lens = sample_lengths(
        rng, spec.random_input_len, spec.random_range_ratio, spec.num_prompts
    )
    output_lens = sample_lengths(
        rng, spec.random_output_len, spec.random_range_ratio, spec.num_prompts
    )
    corpus = RagCorpus(spec, tokenizer, int(prompt_lens.max()))
    samples = []
    for prompt_len, output_len in zip(prompt_lens, output_lens, strict=True):
        sample = corpus.make_prompt(int(prompt_len))
        sample.expected_output_len = int(output_len)
        samples.append(sample)
    return samples
