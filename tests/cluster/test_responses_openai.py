"""`POST /v1/responses` through the `openai` client's `responses.create` and the OpenAI
Agents SDK's default (Responses) model, against one prefill and one decode instance
(local processes, the embedded model, the hermes tool parser as `make serve` would
have it): a response is the chat completion of the same conversation, streamed as
OpenAI's events, with function tools, JSON schemas and the 400s of what is not built.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pydantic
import pytest

from experiments.serving import LOCAL, MODEL, ServeProcess, served
from tests.chat_messages import assistant_tool_call
from tests.cluster.weather_agent import assert_the_agent_calls_its_tool

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL,
    "--num-prefill",
    "1",
    "--num-decode",
    "1",
    "--kv-cache-memory",
    "64MiB",
    "--max-model-len",
    "1024",
    "--dtype",
    "float32",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS, clean=True) as process:
        yield process


def test_a_response_is_the_chat_completion_of_the_same_conversation(server) -> None:
    """Whole and streamed as OpenAI's events, the text and usage of the chat completion."""
    client = server.openai()
    question = "What is the capital of France?"
    kwargs = dict(model=MODEL, instructions="Answer briefly.", input=question,
                  max_output_tokens=8, temperature=0)  # fmt: skip
    response = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": question}],
    )  # fmt: skip
    assert response.object == "response" and response.model == MODEL
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.store is False and response.instructions == "Answer briefly."
    end = {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    assert response.status == end
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{end}"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == response.output_text
    assert final.usage.output_tokens == response.usage.output_tokens


def test_max_output_tokens_leaves_the_response_incomplete(server) -> None:
    response = server.openai().responses.create(
        model=MODEL, input="Tell me a long story.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_message_items_and_function_call_outputs_make_the_chat_turns(server) -> None:
    client = server.openai()
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]
    response = client.responses.create(
        model=MODEL,
        input=items,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=MODEL,
        max_tokens=8,
        temperature=0,
        tool_choice="none",
        tools=[
            {
                "type": "function",
                "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
            }
        ],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            assistant_tool_call("get_weather", '{"city": "Oslo"}', call_id="call_1"),
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        ],
    )
    assert response.output_text == chat.choices[0].message.content


def test_function_tools_come_back_as_function_call_items(server) -> None:
    """A named function, whole and streamed (its arguments as they are sampled); the
    agent below runs `required`."""
    client = server.openai()
    kwargs = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=40)  # fmt: skip
    response = client.responses.create(**kwargs)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather", response.output
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert call.call_id.startswith("call_") and response.status == "completed"
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    assert kinds.count("response.function_call_arguments.delta") > 1  # as they are sampled
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [streamed] = events[-1].response.output
    assert "".join(deltas) == done.arguments == streamed.arguments == call.arguments


class City(pydantic.BaseModel):
    name: str
    population_millions: float


def test_text_format_json_schema_constrains_the_output(server) -> None:
    """The chat API's constraint path: the float ends and the object parses."""
    response = server.openai().responses.parse(
        model=MODEL,
        input="Tell me about Tokyo.",
        text_format=City,
        temperature=0,
        max_output_tokens=100,
    )
    assert response.status == "completed"
    assert response.output_parsed.name == "Tokyo"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"store": True}, "store", "stores no responses"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported field"),
        ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            "text parts only",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "'reasoning'"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
            "text.format",
            "not a valid JSON schema",
        ),
    ],
)
def test_what_is_not_built_is_a_400_naming_the_field(server, fields, param, says) -> None:
    body = {"model": MODEL, "input": "Hi", **fields}
    reply = server.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_an_agent_calls_its_tool_through_the_default_responses_model(server) -> None:
    """The OpenAI Agents SDK's default model is its Responses model: the agent calls the
    tool (`required` on the first turn, then left to the model), reads its result and
    answers."""
    import agents

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=server.async_openai())
    assert_the_agent_calls_its_tool(model)


def test_the_client_raises_the_400_too(server) -> None:
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        server.openai().responses.create(model=MODEL, input="Hi", previous_response_id="r")
