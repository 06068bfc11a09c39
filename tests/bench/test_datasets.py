"""Benchmark datasets: lengths, determinism, file formats, RAG prefix reuse."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.datasets import DatasetSpec, build_samples
from pdserve.bench.rag import MIN_QUESTION_TOKENS
from pdserve.bench.tokenizer import ApproximateTokenizer, ServerTokenizer


def test_random_lengths_stay_within_the_range_ratio_and_repeat_by_seed() -> None:
    spec = DatasetSpec(
        num_prompts=200, random_input_len=100, random_output_len=20, random_range_ratio=0.25, seed=4
    )
    samples = build_samples(spec)
    tokenizer = ApproximateTokenizer()
    assert all(75 <= s.prompt_len <= 125 for s in samples)
    assert all(15 <= s.expected_output_len <= 25 for s in samples)
    assert all(tokenizer.count(s.prompt) == s.prompt_len for s in samples)
    assert len({s.prompt_len for s in samples}) > 20
    assert build_samples(spec) == samples
    assert build_samples(DatasetSpec(**{**spec.__dict__, "seed": 5})) != samples


def test_sharegpt_json_and_jsonl(tmp_path) -> None:
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"question number {i} about things"},
                {"from": "gpt", "value": "an answer " * (i + 2)},
            ]
        }
        for i in range(6)
    ]
    conversations.append(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short"}]}
    )
    conversations.append({"id": "no conversation"})
    as_json = tmp_path / "share.json"
    as_json.write_text(json.dumps(conversations))
    as_jsonl = tmp_path / "share.jsonl"
    as_jsonl.write_text("\n".join(json.dumps(c) for c in conversations))
    for path in (as_json, as_jsonl):
        samples = build_samples(DatasetSpec("sharegpt", str(path), num_prompts=10))
        assert len(samples) == 6  # the short pair and the malformed record are dropped
        for sample in samples:
            number = int(sample.prompt.split()[2])
            assert sample.prompt_len == 5 and sample.expected_output_len == 2 * (number + 2)
    fixed = build_samples(
        DatasetSpec("sharegpt", str(as_json), num_prompts=3, sharegpt_output_len=7)
    )
    assert [s.expected_output_len for s in fixed] == [7, 7, 7]


def test_jsonl_replay_records(tmp_path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text(
        '{"prompt": "one two three", "output_len": 4, "timestamp": 10.5}\n'
        '{"prompt": [5, 6, 7, 8], "max_tokens": 2, "timestamp": 11.0}\n'
    )
    first, second = build_samples(DatasetSpec("jsonl", str(path), num_prompts=10))
    assert (first.prompt_len, first.expected_output_len, first.timestamp) == (3, 4, 10.5)
    assert (second.prompt, second.prompt_len, second.expected_output_len) == ([5, 6, 7, 8], 4, 2)
    path.write_text('{"prompt": "x", "output_len": 1}\n{"prompt": "y"}\n')
    with pytest.raises(ValueError, match="record 2 needs a positive integer 'output_len'"):
        build_samples(DatasetSpec("jsonl", str(path)))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON or JSONL"):
        build_samples(DatasetSpec("jsonl", str(path)))


def rag_spec(**overrides) -> DatasetSpec:
    settings = dict(
        name="rag",
        num_prompts=60,
        random_input_len=1500,
        random_output_len=16,
        random_range_ratio=0.3,
        rag_num_documents=4,
        rag_chunk_len=128,
        seed=9,
    )
    settings.update(overrides)
    return DatasetSpec(**settings)


def test_rag_prompts_share_document_prefixes_with_exact_lengths(scripted_server) -> None:
    scripted_server.script(tokenize=True)
    tokenizer = ServerTokenizer(scripted_server.base_url, None)
    samples = build_samples(rag_spec(), tokenizer)
    assert all(isinstance(s.prompt, list) and len(s.prompt) == s.prompt_len for s in samples)
    assert all(1050 <= s.prompt_len <= 1950 for s in samples)
    first_chunks = [tuple(s.prompt[:128]) for s in samples]
    # Every prompt opens with the first chunk of one of the 4 documents...
    assert len(set(first_chunks)) <= 4
    # ...the most popular document comes up again and again...
    assert max(first_chunks.count(c) for c in set(first_chunks)) >= 20
    # ...and each ends in a question of its own.
    assert len({tuple(s.prompt[-MIN_QUESTION_TOKENS:]) for s in samples}) == len(samples)
    assert build_samples(rag_spec(), tokenizer) == samples


def test_rag_text_prompts_with_the_approximate_tokenizer() -> None:
    samples = build_samples(rag_spec(num_prompts=10, random_input_len=400, random_range_ratio=0.0))
    tokenizer = ApproximateTokenizer()
    assert all(isinstance(s.prompt, str) and s.prompt_len == 400 for s in samples)
    assert all(tokenizer.count(s.prompt) == 400 for s in samples)
    assert all("Question:" in s.prompt for s in samples)
    assert len({s.prompt.split("\n\n")[0] for s in samples}) <= 4
