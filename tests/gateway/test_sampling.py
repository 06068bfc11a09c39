"""From request bodies to SamplingParams: checkpoint defaults, limits, one-line errors."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.common.messages import InstanceAddress, InstanceInfo
from pdserve.gateway.errors import APIError
from pdserve.gateway.sampling import build_sampling_params
from pdserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, decode_body

JSON = "application/json"


def completion(**fields) -> CompletionRequest:
    return decode_body(msgspec.json.encode({"prompt": "x", **fields}), JSON, CompletionRequest)


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(body), JSON, ChatCompletionRequest)


def test_unset_fields_take_the_checkpoint_defaults_and_set_ones_win() -> None:
    # Defaults as an instance reports them: ints stay ints across the wire.
    generation = {"temperature": 0.6, "top_k": 50, "max_new_tokens": 7}
    address = InstanceAddress("i", "colocated", "tcp://x")
    info = InstanceInfo(address, "tcp://y", "m", 100, 10, 16, 8, 4, generation)
    defaults = msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=InstanceInfo)
    params = build_sampling_params(chat(), defaults.generation_defaults, 100, 10)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 50, 7)
    assert isinstance(params.top_k, int)
    explicit = build_sampling_params(chat(temperature=0, top_k=-1, max_tokens=3), {}, 100, 10)
    assert (explicit.temperature, explicit.top_k, explicit.max_tokens) == (0.0, 0, 3)
    # Chat without max_tokens may use the rest of the context; completions default to 16.
    assert build_sampling_params(chat(), {}, 100, 10).max_tokens == 90
    assert build_sampling_params(completion(), {}, 100, 10).max_tokens == 16


def test_chat_fields_map_onto_sampling_params() -> None:
    params = build_sampling_params(
        chat(max_completion_tokens=5, max_tokens=9, logprobs=True, top_logprobs=3, stop="END",
             seed=4, ignore_eos=True, min_tokens=2, repetition_penalty=1.2),
        {}, 100, 10,
    )  # fmt: skip
    assert params.max_tokens == 5  # max_completion_tokens wins over the deprecated field
    assert (params.logprobs, params.stop, params.seed) == (3, ["END"], 4)
    assert (params.ignore_eos, params.min_tokens, params.repetition_penalty) == (True, 2, 1.2)
    assert build_sampling_params(chat(logprobs=True), {}, 100, 10).logprobs == 0


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (completion(max_tokens=95), "max_tokens"),
        (completion(n=0), "n"),
        (completion(logprobs=21), "logprobs"),
        (chat(echo=True), "echo"),
        (completion(max_tokens=0), "max_tokens"),  # the prompt alone needs echo
        (completion(prompt_logprobs=21), "prompt_logprobs"),
        (completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
        (completion(logit_bias={"5": 100.5}), "logit_bias"),
        (completion(logit_bias={"five": 1}), "logit_bias"),
        (completion(logit_bias={"-1": 1}), "logit_bias"),
        (completion(logit_bias={"9" * 5000: 1}), "logit_bias"),
        (completion(logit_bias={"1_0": 1}), "logit_bias"),
        (chat(top_logprobs=1), "top_logprobs"),
        (completion(temperature=-0.5), "temperature"),
    ],
)
def test_out_of_range_values_are_400s(request_, param) -> None:
    with pytest.raises(APIError) as error:
        build_sampling_params(request_, {}, 100, 10)
    assert error.value.status == 400 and error.value.param == param
    assert "\n" not in error.value.message


def test_body_decoding_names_the_field_and_checks_the_content_type() -> None:
    with pytest.raises(APIError) as error:
        decode_body(b'{"prompt": "x", "n": "two"}', JSON, CompletionRequest)
    assert error.value.param == "n" and "Expected `int`" in error.value.message
    with pytest.raises(APIError) as error:
        decode_body(b'{"prompt": "x"}', "text/plain", CompletionRequest)
    assert error.value.status == 415
    assert decode_body(b'{"prompt": "x", "user": "u"}', "application/json; charset=utf-8",
                       CompletionRequest).prompt == "x"  # fmt: skip


def test_echo_logit_bias_and_prompt_logprobs_map_onto_sampling_params() -> None:
    echoed = build_sampling_params(completion(echo=True, logprobs=2, max_tokens=0), {}, 100, 10)
    # The prompt's entries carry as many alternatives as the generated ones; max_tokens 0
    # generates one token the reply does not show.
    assert (echoed.prompt_logprobs, echoed.logprobs, echoed.max_tokens) == (2, 2, 1)
    assert build_sampling_params(completion(echo=True), {}, 100, 10).prompt_logprobs is None
    asked = build_sampling_params(chat(prompt_logprobs=0), {}, 100, 10)
    assert asked.prompt_logprobs == 0
    biased = build_sampling_params(
        completion(logit_bias={"7": -100, "12": 2.5}), {}, 100, 10, vocab_size=13
    )
    assert biased.logit_bias == {7: -100.0, 12: 2.5}
    with pytest.raises(APIError, match="outside the vocabulary") as error:
        build_sampling_params(completion(logit_bias={"13": 1}), {}, 100, 10, vocab_size=13)
    assert error.value.param == "logit_bias"
