"""The OpenAI Agents SDK's weather agent, shared by the suites of its two model kinds
(chat completions and Responses): one tool, required on the first turn."""

from __future__ import annotations

import asyncio
from typing import Any

QUESTION = "What is the weather in Oslo?"


def assert_the_agent_calls_its_tool(model: Any) -> None:
    """The agent over `model` (an `agents` model on the server) calls the tool
    (`required` on the first turn, then left to the model, the SDK's default), reads
    its result and answers with it."""
    import agents  # an optional test dependency: imported where a test runs it

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 21 C."

    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                    temperature=0, max_tokens=60)  # fmt: skip
    agent = agents.Agent(name="weather", instructions="Answer with the tool's result.",
                         tools=[get_weather], model=model, model_settings=settings)  # fmt: skip
    agents.set_tracing_disabled(True)
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=3))
    assert calls == ["Oslo"]
    assert "Sunny in Oslo" in result.final_output, result.final_output
