"""A streamed reply's chunks: the opening entries (chat's role) come with the first
token, as vLLM sends them, so a client that times its first chunk measures the prefill."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from pdserve.gateway.replies import _chunks


class Form:
    """Chat's shape in brief: an opening entry per choice, then each update's text."""

    def opening(self, choice: Any) -> dict[str, Any]:
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}}

    def chunk(self, update: Any) -> dict[str, Any]:
        return {"index": update.choice.index, "delta": {"content": update.text}}


class Run:
    """A run whose first token waits for `first_token`."""

    def __init__(self) -> None:
        self.first_token = asyncio.Event()
        self.choices = [SimpleNamespace(index=0), SimpleNamespace(index=1)]

    async def updates(self) -> AsyncIterator[Any]:
        await self.first_token.wait()
        for text in ("Hel", "lo"):
            yield SimpleNamespace(
                choice=self.choices[0], text=text, finish_reason=None, logprobs=[]
            )

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def entries(chunk: bytes) -> list[dict[str, Any]]:
    return json.loads(chunk.decode().removeprefix("data: "))["choices"]


async def _collect() -> None:
    run = Run()
    chunks = _chunks(run, {"id": "chatcmpl-1"}, Form(), (False, False), gateway=None)  # type: ignore[arg-type]
    first = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0.2)
    assert not first.done(), f"a chunk before the first token: {first.result()!r}"
    run.first_token.set()
    openings = [entries(await first), entries(await anext(chunks))]
    assert [e[0]["delta"] for e in openings] == [{"role": "assistant", "content": ""}] * 2
    assert [e[0]["index"] for e in openings] == [0, 1]
    texts = [entries(await anext(chunks))[0]["delta"]["content"] for _ in range(2)]
    assert texts == ["Hel", "lo"]
    assert await anext(chunks) == b"data: [DONE]\n\n"


def test_the_role_comes_with_the_first_token() -> None:
    asyncio.run(_collect())


class FailingRun(Run):
    async def updates(self) -> AsyncIterator[Any]:
        raise RuntimeError("instance failed before the first token")
        yield  # an async generator


async def _collect_failure() -> list[bytes]:
    gateway = SimpleNamespace(stream_error=lambda exc: {"error": {"message": str(exc)}})
    chunks = _chunks(FailingRun(), {"id": "chatcmpl-2"}, Form(), (True, True), gateway)  # type: ignore[arg-type]
    return [chunk async for chunk in chunks]


def test_a_failure_before_the_first_token_is_the_error_alone() -> None:
    """No role for a reply that never had a token (vLLM sends none either)."""
    chunks = asyncio.run(_collect_failure())
    assert len(chunks) == 2 and chunks[1] == b"data: [DONE]\n\n", chunks
    assert json.loads(chunks[0].decode().removeprefix("data: ")) == {
        "error": {"message": "instance failed before the first token"}
    }
