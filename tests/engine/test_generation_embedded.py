"""The embedded model generates exactly what transformers generates (fp32, greedy),
also when prompts are chunked, blocks run out, and prefixes come from the cache."""

from __future__ import annotations

import pytest
import torch

from experiments.cpu_bf16_accuracy import QUESTIONS
from pdserve import LLM, SamplingParams
from pdserve.engine.embedded import embedded_model_path
from tests.engine.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

MAX_NEW = 64
SHORT = 16  # the other scenarios compare a prefix: greedy runs agree token by token


@pytest.fixture(scope="module")
def folder() -> str:
    return str(embedded_model_path())


def _llm(**engine_args) -> LLM:
    # 256 MiB hold 5824 fp32 tokens: max_model_len must fit in the cache (8192 would not).
    engine_args = {"max_model_len": 2048, **engine_args}
    return LLM(dtype="float32", kv_cache_memory=256 << 20, **engine_args)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    return _llm()


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def expected(folder, prompts) -> list[list[int]]:
    return [hf_greedy(folder, p, MAX_NEW) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
GREEDY_SHORT = SamplingParams(temperature=0.0, max_tokens=SHORT)


def test_chat_prompts_match_transformers(llm, prompts, expected):
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    # The text is the decoding of those tokens (eos is a special token, so skipped).
    tok = llm.get_tokenizer()
    assert outputs[0].text == tok.decode(expected[0], skip_special_tokens=True)


def test_chunked_prefill_mixes_prefill_with_decodes(prompts, expected):
    llm = _llm(max_num_batched_tokens=24)
    assert max(len(p) for p in prompts) > 24  # every long prompt is split
    outputs = llm.generate(prompts[:8], GREEDY_SHORT)
    assert [o.token_ids for o in outputs] == [e[:SHORT] for e in expected[:8]]
    assert llm.engine.stats.mixed_steps > 0


def test_preemption_recomputes_identically(prompts, expected):
    # Requests that run 32 tokens without stopping grow from 3 blocks to 5 each; 14
    # blocks admit four prompts but not their growth, so running requests get preempted.
    n = 32
    long = [i for i, e in enumerate(expected) if len(e) >= n][:8]
    assert len(long) >= 6
    llm = _llm(num_kv_blocks=14, max_model_len=14 * 16)  # one request may fill the pool
    outputs = llm.generate([prompts[i] for i in long], SamplingParams(temperature=0, max_tokens=n))
    assert llm.engine.scheduler.stats().num_preemptions_total > 0
    assert [o.token_ids for o in outputs] == [expected[i][:n] for i in long]
    llm.engine.scheduler.check_invariants()


def _with_shared_document(llm: LLM, question: str) -> list[int]:
    document = (
        "The Eiffel Tower was built for the 1889 World's Fair in Paris. It is 330 metres tall "
        "and was the tallest man-made structure in the world until 1930. Gustave Eiffel's "
        "company designed and built it, and millions of people visit it every year. "
    )
    tok = llm.get_tokenizer()
    content = document + question
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": content}]), add_special_tokens=False
    )


def test_prefix_cache_hit_computes_only_the_new_tokens(folder):
    llm = _llm()
    first = _with_shared_document(llm, "How tall is it?")
    second = _with_shared_document(llm, "Who built it?")
    llm.generate([first], GREEDY_SHORT)
    stats_before = llm.engine.scheduler.stats()
    computed_before = llm.engine.stats.prompt_tokens_computed

    out = llm.generate([second], GREEDY_SHORT)[0]

    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    block = llm.engine.config.block_size
    cached = shared // block * block
    assert cached >= 48
    assert out.num_cached_tokens == cached
    assert llm.engine.stats.prompt_tokens_computed - computed_before == len(second) - cached
    stats = llm.engine.scheduler.stats()
    assert stats.prefix_cache_hits_total - stats_before.prefix_cache_hits_total == cached
    assert out.token_ids == hf_greedy(folder, second, SHORT)


def test_cached_blocks_are_really_read(folder):
    """Corrupting the KV pool after the first request changes the second one's output
    only when its prefix comes from the cache: the hit is used, not recomputed."""
    outputs = {}
    for caching in (True, False):
        llm = _llm(enable_prefix_caching=caching)
        first = _with_shared_document(llm, "How tall is it?")
        second = _with_shared_document(llm, "Who built it?")
        llm.generate([first], SamplingParams(temperature=0, max_tokens=1))
        gen = torch.Generator().manual_seed(0)
        storage = llm.engine.executor.worker.kv_cache.storage
        storage.copy_(torch.randn(storage.shape, generator=gen) * 3)
        outputs[caching] = llm.generate([second], GREEDY_SHORT)[0].token_ids
    expected = hf_greedy(folder, second, SHORT)
    assert outputs[False] == expected
    assert outputs[True] != expected
