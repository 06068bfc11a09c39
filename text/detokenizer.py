"""Turning generated token ids into streamed text, and cutting it at stop strings.

Both run in the front end (the gateway, or the offline `LLM`): instances stop on token ids and
lengths only. No torch here.

    stream = TextStream(tokenizer, stop=["\\n\\n"], include_stop_str_in_output=False)
    for ids in new_tokens_per_step:
        delta = stream.add_tokens(ids)      # TextDelta(text, stopped, stop_string)
        ...                                 # stop the request when delta.stopped
    tail = stream.finish()                  # text held back while waiting for more tokens
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    Each step decodes only a short window: the tokens since the last emitted boundary, with and
    without the new ones, and emits the difference. A window whose text ends in U+FFFD is a
    multi-byte character split across tokens, so nothing is emitted until a later token
    completes it (or `flush` is called). The deltas add up to `decode(all ids)`.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._window_start = 0  # a character boundary: text so far = decode(ids[:_emitted_end])
        self._emitted_end = 0

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is split)."""
        self.token_ids.extend(token_ids)
        if len(self.token_ids) == self._emitted_end:
            return ""
        window = self._decode(self.token_ids[self._window_start :])
        if window.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(window)

    def flush(self) -> str:
        """Emit whatever is held back, even an incomplete character (at the end of a request)."""
        if len(self.token_ids) == self._emitted_end:
            return ""
        return self._emit(self._decode(self.token_ids[self._window_start :]))

    def _emit(self, window: str) -> str:
        emitted_part = self._decode(self.token_ids[self._window_start : self._emitted_end])
        if window.startswith(emitted_part):
            delta = window[len(emitted_part) :]
        else:
            # A decoder whose output for a token depends on what follows it (rare): fall back
            # to decoding everything and diffing against what was already sent.
            full = self._decode(self.token_ids)
            delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self._window_start = self._emitted_end
        self._emitted_end = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


@dataclass(frozen=True)
class TextDelta:
    text: str  # safe to show: never a piece of a stop string that may still be cut
    stopped: bool = False
    stop_string: str | None = None  # which stop string ended the text, when stopped


class StopStringMatcher:
    """Finds stop strings in streamed text, even when one spans several deltas.

    Text that could still become the start of a stop string is held back (when the stop
    string is to be dropped), so what was released never has to be taken back. On a match the
    text ends at the stop string, which is kept or dropped per `include_stop_str_in_output`.
    """

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.stop = list(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""  # not yet released: could be the start of a stop string
        # The end of the released text, so a match that began there is still seen (only
        # possible when released text may hold a partial stop string, i.e. when including it).
        self._context = ""
        self._context_size = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False
        self.stop_string: str | None = None

    def feed(self, text: str) -> TextDelta:
        if self.stopped:
            return TextDelta("", True, self.stop_string)
        if not self.stop:
            return TextDelta(text)
        search = self._context + self.held + text
        offset = len(self._context)
        match = self._first_completed(search)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop_str_in_output else max(start, offset)
            self.held, self.stopped, self.stop_string = "", True, stop
            return TextDelta(search[offset:end], True, stop)
        keep = 0 if self.include_stop_str_in_output else self._partial_suffix_length(search)
        keep = min(keep, len(search) - offset)
        released = search[offset : len(search) - keep]
        self.held = search[len(search) - keep :] if keep else ""
        if self._context_size:
            self._context = (self._context + released)[-self._context_size :]
        return TextDelta(released)

    def flush(self) -> str:
        """The held-back text, released when the text ends without completing a stop string."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _first_completed(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first; at a tie, the longer string.

        Ending first, not starting first, is what a check after every character would find,
        so the result does not depend on how the text was cut into deltas."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stop:
            index = buffer.find(stop)
            if index >= 0:
                candidate = (index + len(stop), -len(stop), stop)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[0] + best[1], best[2])

    def _partial_suffix_length(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class TextStream:
    """Token ids in, displayable text deltas out: detokenization plus stop strings."""

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.matcher = StopStringMatcher(stop, include_stop_str_in_output)
        self.text = ""  # everything released so far

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def stop_string(self) -> str | None:
        return self.matcher.stop_string

    def add_tokens(self, token_ids: Iterable[int]) -> TextDelta:
        return self._release(self.matcher.feed(self.detokenizer.add_tokens(token_ids)))

    def finish(self) -> TextDelta:
        """At the end of the request: release held text, checking it for a stop string."""
        delta = self.matcher.feed(self.detokenizer.flush())
        if not delta.stopped:
            delta = TextDelta(delta.text + self.matcher.flush())
        return self._release(delta)

    def _release(self, delta: TextDelta) -> TextDelta:
        self.text += delta.text
        return delta
