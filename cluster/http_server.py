"""The gateway's HTTP server: uvicorn with bounds on slow and idle clients.

uvicorn (h11) closes a keep-alive connection idle between requests after
`timeout_keep_alive`, but not a fresh connection that never sends a request, nor one
that sends its request head a byte at a time (slowloris): each holds a socket and a
file descriptor for as long as the client likes. `GuardedH11Protocol` gives every
request head `HEAD_TIMEOUT_S` from the connection (or the end of the previous request)
to arrive whole, else closes the connection. Heads are capped in size by h11 (a 400
past uvicorn's 16 KiB); bodies are bounded in size and time by the gateway
(`gateway/schemas.py:read_limited`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5


class GuardedH11Protocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """A timer runs while the client owes a request head (h11: they are IDLE)."""
        if self.transport.is_closing():
            return
        waiting = self.conn.their_state is h11.IDLE
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)
        elif not waiting:
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app: Any, log_level: str = "warning", **overrides: Any) -> uvicorn.Config:
    """The settings `pdserve serve` runs uvicorn with (tests reuse them)."""
    settings: dict[str, Any] = {
        "log_level": log_level,
        "access_log": log_level == "debug",
        "lifespan": "off",
        "timeout_graceful_shutdown": 5,
        "http": GuardedH11Protocol,
        "timeout_keep_alive": KEEP_ALIVE_S,
        **overrides,
    }
    return uvicorn.Config(app, **settings)
