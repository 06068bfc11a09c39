"""One choice (one engine request) as a front end sees it: token ids and logprobs in, text out,
ended by the engine or by a stop string.

The gateway and the offline `LLM` both keep one `ChoiceText` per choice and feed it the
engine's output deltas; what each does about a result (abort on the instances, end the request
in the engine, observe metrics) stays with it. Instances stop on token ids and lengths only, so
a stop string is matched here, and the front end must then end the request itself.

    choice = ChoiceText.for_params(tokenizer, params)
    for delta in deltas:
        absorbed = choice.absorb(delta)     # Absorbed(text, finish_reason, end_request)
        if absorbed.end_request:
            ...                             # the engine does not know: end the request there
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, overload

from pdserve.text.detokenizer import Decoder, TextStream


class TextParams(Protocol):
    """What a choice's text depends on (`SamplingParams` fits)."""

    @property
    def stop(self) -> Sequence[str]: ...
    @property
    def include_stop_str_in_output(self) -> bool: ...
    @property
    def skip_special_tokens(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...


class OutputDelta(Protocol):
    """One engine output for one request (`RequestDelta` fits); `finish_reason` is set on the
    last one."""

    @property
    def new_token_ids(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[Any] | None: ...
    @property
    def prompt_logprobs(self) -> Sequence[Any | None] | None: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stop_reason(self) -> int | str | None: ...
    @property
    def num_cached_tokens(self) -> int: ...


@dataclass(frozen=True)
class Absorbed:
    text: str  # newly released text
    finish_reason: str | None = None  # set when this delta ended the choice
    # A stop string ended the choice before the engine did: the front end must end the request.
    end_request: bool = False


@dataclass
class ChoiceText:
    stream: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None  # None unless logprobs were asked for
    # Prompt tokens 1..n-1's logprobs, when asked for: from the first delta that has them
    # (a retried request's may come twice).
    prompt_logprobs: list[Any | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @classmethod
    def for_params(cls, tokenizer: Decoder, params: TextParams, **fields: Any) -> Self:
        """A new choice; `fields` are a subclass's own."""
        stream = TextStream(
            tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        logprobs: list[Any] | None = [] if params.logprobs is not None else None
        return cls(stream=stream, logprobs=logprobs, **fields)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, delta: OutputDelta) -> Absorbed:
        """Takes in one output delta; a choice already ended by a stop string ignores the
        rest (the engine may have produced more before it heard)."""
        if self.finished:
            return Absorbed("")
        self.token_ids.extend(delta.new_token_ids)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(delta.prompt_logprobs)
        self.num_cached_tokens = delta.num_cached_tokens
        if self.logprobs is not None and delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        released = self.stream.add_tokens(delta.new_token_ids)
        if released.stopped:
            self.finish_reason, self.stop_reason = "stop", released.stop_string
            return Absorbed(released.text, "stop", end_request=True)
        if delta.finish_reason is None:
            return Absorbed(released.text)
        tail = self.stream.finish()  # held-back text, which may complete a stop string
        if tail.stopped:
            self.finish_reason, self.stop_reason = "stop", tail.stop_string
        else:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        return Absorbed(released.text + tail.text, self.finish_reason)


@overload
def choice_seeds(seed: int | None, n: int, rng: random.Random) -> list[int]: ...
@overload
def choice_seeds(seed: int | None, n: int, rng: None = None) -> list[int | None]: ...
def choice_seeds(
    seed: int | None, n: int, rng: random.Random | None = None
) -> list[int] | list[int | None]:
    """The seeds of one prompt's `n` choices: `seed + j`, so a seeded request repeats choice
    by choice. Without a seed, a fresh 63-bit one from `rng` each, or None when there is no
    `rng` (the engine then draws one from its own seeded generator)."""
    if seed is not None:
        return [seed + j for j in range(n)]
    return [None if rng is None else rng.getrandbits(63) for _ in range(n)]
