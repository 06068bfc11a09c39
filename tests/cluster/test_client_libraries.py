"""The client libraries people put in front of an OpenAI-compatible server, each as its
user writes it (docs/clients.md), against one prefill and one decode instance started as
`make serve` starts them (local processes, the embedded model, the hermes tool parser):
LangChain's `ChatOpenAI`, instructor and the OpenAI Agents SDK's chat-completions model.
(The `openai` client and the Agents SDK's default Responses model have their own modules:
test_structured_openai.py, test_responses_openai.py.)

The embedded model has 135M parameters: where a library leaves calling a tool to the
model, the tests force the call through `tool_choice` as a user would, and check what
comes back, not the model's judgement.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pydantic
import pytest

from experiments.serving import LOCAL, MODEL, ServeProcess, served
from tests.cluster.weather_agent import assert_the_agent_calls_its_tool

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "1", "--kv-cache-memory", "64MiB",
    "--max-model-len", "1024", "--dtype", "float32",  # fp32: greedy text has no near-ties
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",  # what `make serve` adds
)  # fmt: skip
PROMPT = "Tokyo has 14 million people. Give its name and population in millions as JSON."
WEATHER_QUESTION = "What is the weather in Oslo?"


class City(pydantic.BaseModel):
    name: str
    population_millions: float


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS, clean=True) as process:
        yield process


def _valid_city(city: object) -> None:
    assert isinstance(city, City), city
    assert city.name and math.isfinite(city.population_millions), city


# ---- LangChain -----------------------------------------------------------------------


def _chat_openai(server: ServeProcess, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, model=MODEL,
                      temperature=0, max_retries=0, **kwargs)  # fmt: skip


def test_langchain_structured_output_is_a_valid_object(server) -> None:
    """`with_structured_output(method="json_schema")`: the schema constrains the sampling,
    so 100 tokens hold a whole object, its float included."""
    structured = _chat_openai(server, max_tokens=100).with_structured_output(
        City, method="json_schema"
    )
    _valid_city(structured.invoke(PROMPT))


def test_langchain_bound_tools_call_and_take_the_result(server) -> None:
    """`bind_tools` (a named `tool_choice`: the model does not choose to call on its own),
    then the tool's result sent back: the library's assistant turn carries the call and a
    null content."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}, 21 C."

    llm = _chat_openai(server, max_tokens=40)
    asked = HumanMessage(WEATHER_QUESTION)
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([asked])
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str), call
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke([asked, reply, result])
    assert isinstance(answer.content, str) and not answer.tool_calls


def test_langchain_stream_is_the_greedy_text_in_chunks(server) -> None:
    llm = _chat_openai(server, max_tokens=16)
    prompt = "Tell me a short story."
    chunks = list(llm.stream(prompt))
    whole = llm.invoke(prompt).content
    assert len(chunks) > 2 and whole
    assert "".join(chunk.content for chunk in chunks) == whole


# ---- instructor ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_returns_a_valid_object(server, mode: str) -> None:
    """`response_format` with a JSON schema (JSON_SCHEMA) and a forced function call
    (TOOLS): both constrained while sampling, so no retry is needed (max_retries=0)."""
    import instructor

    client = instructor.from_openai(server.openai(), mode=instructor.Mode[mode])
    city = client.chat.completions.create(
        model=MODEL, response_model=City, max_tokens=100, temperature=0, max_retries=0,
        messages=[{"role": "user", "content": PROMPT}],
    )  # fmt: skip
    _valid_city(city)


# ---- OpenAI Agents SDK ---------------------------------------------------------------


def test_an_agent_calls_its_tool_through_the_chat_completions_model(server) -> None:
    """`OpenAIChatCompletionsModel`: the agent calls the tool (`required` on the first
    turn, then left to the model, the SDK's default), reads its result and answers."""
    import agents

    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=server.async_openai())
    assert_the_agent_calls_its_tool(model)
