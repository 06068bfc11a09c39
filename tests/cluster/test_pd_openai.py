"""One prefill and one decode instance (local processes) behind the OpenAI API, driven by
the official `openai` client: every answer equals the single-instance engine's, and the
KV really moved (no failures, no prompt token computed on the decode side, bytes =
blocks pulled × bytes per block).

fp32 so greedy and seeded outputs can be compared token for token with `pdserve.LLM`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import msgspec
import pytest

from experiments.serving import LOCAL, MODEL, ServeProcess, served
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import default_block_size
from pdserve.engine.embedded import embedded_model_path
from tests.concurrent_streams import streams_and_alone

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32",
    "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
)  # fmt: skip
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS, clean=True) as process:
        yield process


@pytest.fixture(scope="module")
def llm():
    from pdserve import LLM

    return LLM(dtype="float32", num_threads=1, kv_cache_memory=64 << 20, max_model_len=1024)


@pytest.fixture(scope="module")
def greedy(llm) -> dict[str, str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


def metric(text: str, name: str, role: str) -> float:
    """The sum of a metric over every instance of a role."""
    pattern = rf'^pdserve:{name}{{[^}}]*role="{role}"[^}}]*}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def test_greedy_completions_equal_the_offline_engine(server, greedy) -> None:
    client = server.openai()
    for prompt in PROMPTS:
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert result.choices[0].text == greedy[prompt], prompt
        assert result.choices[0].finish_reason in ("length", "stop")
        assert 1 <= result.usage.completion_tokens <= MAX_TOKENS


def test_streamed_completion_adds_up_and_reports_usage(server, greedy) -> None:
    prompt = PROMPTS[2]
    chunks = list(
        server.openai().completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy[prompt]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 2


def test_chat_streaming_and_not_equals_the_offline_engine(server, llm) -> None:
    expected = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].text
    client = server.openai()
    whole = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == expected
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_stop_strings_cut_the_text(server, greedy) -> None:
    prompt = PROMPTS[1]
    full = greedy[prompt]
    stop = full.strip().split()[1]  # a word that the decode instance produces
    result = server.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].finish_reason == "stop"


def test_seeded_sampling_equals_the_offline_engine(server, llm) -> None:
    """P samples output index 0, D the rest: with randomness keyed on (seed, index) the
    text equals one engine's for the same seed."""
    prompt = "My favourite colour is"
    defaults = llm.get_default_sampling_params()

    def offline(seed: int) -> str:
        params = msgspec.structs.replace(
            defaults, temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True
        )
        return llm.generate(prompt, params)[0].text

    def served(seed: int) -> str:
        return server.openai().completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip

    first = served(1234)
    assert first == offline(1234)
    assert served(1234) == first
    assert served(4321) == offline(4321) != first


def test_logprobs_of_the_first_token_and_the_rest(server, llm) -> None:
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
    expected = llm.generate(prompt, params)[0]
    result = server.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2
    )
    lp = result.choices[0].logprobs
    assert "".join(lp.tokens) == result.choices[0].text == expected.text
    want = [entry.logprob for entry in expected.outputs[0].logprobs]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)


def test_outputs_through_the_handoff_do_not_depend_on_the_load(server, llm) -> None:
    """A long prompt's greedy and seeded tokens and logprobs through P -> D, alone, a
    second time (prefix-cache hits on P and D) and beside 12 other streams, equal the
    offline engine's alone, to the bit (float32)."""
    prompt = "The history of the river begins " + "with stories of kings and floods, " * 12
    cases = [
        (dict(temperature=0.0), SamplingParams(temperature=0.0)),
        (dict(temperature=0.8, seed=5), SamplingParams(temperature=0.8, seed=5)),
    ]
    expected = []
    for _, params in cases:
        params = msgspec.structs.replace(params, max_tokens=10, logprobs=1, ignore_eos=True)
        out = llm.generate(prompt, params)[0].outputs[0]
        expected.append((out.text, [entry.logprob for entry in out.logprobs]))

    def read(result) -> tuple[str, list[float]]:
        choice = result.choices[0]
        return choice.text, choice.logprobs.token_logprobs

    def body(text: str, extra: dict, tokens: int) -> dict:
        return dict(
            model=MODEL, prompt=text, max_tokens=tokens, logprobs=1,
            extra_body={"ignore_eos": True}, **extra,
        )  # fmt: skip

    async def loaded() -> list:
        client = server.async_openai()
        others = [body(f"{PROMPTS[i % 4]} {i}", dict(temperature=0.0), 24) for i in range(12)]
        try:
            calls = [body(prompt, e, 10) for e, _ in cases] + others
            done = await asyncio.gather(*(client.completions.create(**c) for c in calls))
            return [read(r) for r in done[:2]]
        finally:
            await client.close()

    sync = server.openai()
    first = [read(sync.completions.create(**body(prompt, e, 10))) for e, _ in cases]
    again = [read(sync.completions.create(**body(prompt, e, 10))) for e, _ in cases]
    for got in (first, again, asyncio.run(loaded())):
        assert got == expected


def test_32_concurrent_streams(server, greedy) -> None:
    texts, short = streams_and_alone(server, MODEL, PROMPTS)
    assert texts == [short[PROMPTS[i % len(PROMPTS)]] for i in range(32)]
    for prompt, text in short.items():
        assert greedy[prompt].startswith(text)


def test_the_kv_moved(server) -> None:
    """Over everything above: no failed transfer, nothing recomputed on the decode side,
    and every byte received is a whole block of this model's KV."""
    server.wait_idle()
    text = server.get("/metrics").text
    config = json.loads((embedded_model_path() / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    bytes_per_block = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    ) * default_block_size("cpu")
    blocks = metric(text, "kv_transfer_blocks_total", "decode")
    assert blocks >= 40  # every request above pulled at least one block
    assert metric(text, "kv_transfer_bytes_total", "decode") == blocks * bytes_per_block
    assert metric(text, "kv_transfer_bytes_total", "prefill") == blocks * bytes_per_block
    for role in ("prefill", "decode"):
        assert metric(text, "kv_transfer_failures_total", role) == 0
        assert metric(text, "kv_transfer_lease_expiries_total", role) == 0
    assert metric(text, "prompt_tokens_computed_total", "decode") == 0
    assert metric(text, "prompt_tokens_computed_total", "prefill") > 0
    # a pull with every block cached on D moves nothing and is not timed
    timed = metric(text, "kv_transfer_seconds_count", "decode")
    assert 1 <= timed <= metric(text, "kv_transfers_total", "decode")
    assert metric(text, "num_requests_waiting_for_remote_kvs", "decode") == 0
    assert 'pdserve:kv_transfers_in_flight{instance="decode-0",role="decode"} 0.0' in text
