"""Server-sent events, and waiting on a generation while watching the client.

A client that goes away must abort its request everywhere. Starlette cancels a
streaming body when the connection drops; a non-streaming handler is not told, so
`watch_disconnect` polls the connection while the generation runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DISCONNECT_POLL_S = 0.25
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


def sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class AbortingStreamingResponse(StreamingResponse):
    """A streaming response that runs `on_close` however the stream ends (finished,
    client gone, server shutting down), so unfinished requests are always aborted."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def watch_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`; raises ClientDisconnected (after cancelling it) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
