"""Deltas of one request come back in output order, whichever instance sent them first."""

from __future__ import annotations

from pdserve.common.messages import RequestDelta
from pdserve.gateway.request_stream import RequestStream, StreamEvent


def delta(index: int, tokens: list[int], finish: str | None = None) -> RequestDelta:
    return RequestDelta("r", tokens, index, finish_reason=finish)


def collect() -> tuple[RequestStream, list[StreamEvent]]:
    events: list[StreamEvent] = []
    return RequestStream("r", events.append), events


def test_decode_tokens_overtaking_the_prefill_token_wait_for_it() -> None:
    stream, events = collect()
    assert not stream.push(delta(1, [11]), "decode-0", 1.0)
    assert not stream.push(delta(2, [12]), "decode-0", 2.0)
    assert events == []  # index 0 (from the prefill instance) has not arrived
    assert not stream.push(delta(0, [10]), "prefill-0", 3.0)
    assert [e.delta.output_index for e in events] == [0, 1, 2]
    assert [e.source for e in events] == ["prefill-0", "decode-0", "decode-0"]
    assert stream.push(delta(3, [13], "length"), "decode-0", 4.0)
    assert events[-1].final and stream.closed


def test_multi_token_deltas_and_repeats() -> None:
    stream, events = collect()
    stream.push(delta(0, [1, 2, 3]), "c", 0.0)
    stream.push(delta(1, [2]), "c", 0.0)  # already released: dropped
    stream.push(delta(3, [4]), "c", 0.0)
    assert [e.delta.new_token_ids for e in events] == [[1, 2, 3], [4]]
    assert stream.next_index == 4


def test_nothing_after_the_end_or_a_failure() -> None:
    stream, events = collect()
    stream.push(delta(0, [1], "stop"), "c", 0.0)
    assert stream.push(delta(1, [2]), "c", 0.0)
    assert len(events) == 1
    failing, failed = collect()
    failing.push(delta(1, [5]), "d", 0.0)
    failing.fail("instance died")
    failing.fail("again")
    assert [e.error for e in failed] == ["instance died"]
    assert failing.push(delta(0, [4]), "p", 0.0)  # closed: nothing more is released
    assert len(failed) == 1


def test_an_error_without_tokens_ends_the_request_in_order() -> None:
    stream, events = collect()
    stream.push(delta(0, [1]), "c", 0.0)
    error = RequestDelta("r", [], 1, finish_reason="error", error="boom")
    assert stream.push(error, "c", 0.0)
    assert events[-1].delta.error == "boom" and events[-1].final
