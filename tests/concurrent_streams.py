"""Many greedy streams at once against one server, next to each prompt run alone: what
batching must not change."""

from __future__ import annotations

import asyncio

from experiments.serving import ServeProcess


def streams_and_alone(
    server: ServeProcess, model: str, prompts: list[str], count: int = 32, max_tokens: int = 4
) -> tuple[list[str], dict[str, str]]:
    """The texts of `count` concurrent streams (the prompts in turn), and each prompt's
    text from a request of its own."""
    client = server.async_openai()

    async def one(prompt: str) -> str:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def run_all() -> list[str]:
        try:
            return await asyncio.gather(*(one(prompts[i % len(prompts)]) for i in range(count)))
        finally:
            await client.close()

    def alone(prompt: str) -> str:
        reply = sync.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return reply.choices[0].text

    streamed = asyncio.run(run_all())
    sync = server.openai()
    return streamed, {p: alone(p) for p in prompts}
