"""Puts one request's token deltas back in order before anyone reads them.

With disaggregation the first token comes from the prefill instance and the rest from
the decode instance, over different sockets: they can arrive in either order. Each
delta carries the output index of its first token; a delta is released only once
every token before it was, and the request ends when its finishing delta is released.

The tokens released so far are kept: a request whose instance dies mid-stream is sent
again with them as its output (`Dispatcher._retry`), and the same stream goes on from
the next index. Tokens a delta repeats (a late one from the former attempt) are cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pdserve.common.messages import RequestDelta


@dataclass(frozen=True)
class StreamEvent:
    """A delta released in order (`delta`), or the request failing (`error`)."""

    request_id: str
    source: str = ""  # the instance that produced the delta
    delta: RequestDelta | None = None
    error: str | None = None
    arrival: float = 0.0  # time.perf_counter() when the gateway received it

    @property
    def final(self) -> bool:
        return self.error is not None or (self.delta is not None and self.delta.finished)


class RequestStream:
    def __init__(self, request_id: str, sink: Callable[[StreamEvent], None]) -> None:
        self.request_id = request_id
        self.sink = sink
        self.token_ids: list[int] = []  # released so far, in order
        self.pending: dict[int, tuple[RequestDelta, str, float]] = {}
        self.closed = False

    @property
    def next_index(self) -> int:
        """Output index of the next token to release."""
        return len(self.token_ids)

    def push(self, delta: RequestDelta, source: str, arrival: float) -> bool:
        """Accepts a delta from an instance; True once the request has ended."""
        if self.closed:
            return True
        if delta.output_index < self.next_index:
            fresh = _without_repeats(delta, self.next_index)
            if fresh is None:
                return False  # only tokens already released
            delta = fresh
        self.pending[delta.output_index] = (delta, source, arrival)
        while self.next_index in self.pending and not self.closed:
            ready, origin, at = self.pending.pop(self.next_index)
            self.token_ids.extend(ready.new_token_ids)
            if ready.finished:
                self.closed = True
            self.sink(StreamEvent(self.request_id, origin, ready, arrival=at))
        return self.closed

    def resend(self) -> None:
        """The request is sent again: deltas held beyond a gap came from the attempt
        that died, which will never fill the gap; the new attempt sends its own."""
        self.pending.clear()

    def fail(self, message: str, arrival: float = 0.0) -> None:
        if not self.closed:
            self.closed = True
            self.sink(StreamEvent(self.request_id, error=message, arrival=arrival))

    def end(self) -> None:
        """Stops releasing (the gateway itself ended the request, e.g. a stop string)."""
        self.closed = True
        self.pending.clear()


def _without_repeats(delta: RequestDelta, next_index: int) -> RequestDelta | None:
    """The part of `delta` from `next_index` on; None if nothing of it is new. A last
    delta stays (an error delta names index 0, and it ends the request all the same)."""
    cut = next_index - delta.output_index
    if cut >= len(delta.new_token_ids) and not delta.finished:
        return None
    logprobs = delta.logprobs[cut:] if delta.logprobs is not None else None
    return msgspec.structs.replace(
        delta, new_token_ids=delta.new_token_ids[cut:], output_index=next_index, logprobs=logprobs
    )
