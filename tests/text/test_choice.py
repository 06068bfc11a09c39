"""One choice's text as both front ends build it: stop strings end it (and the request, when the
engine is still running), held-back text comes out on the last delta, and the seeds of `n`
choices. A decoder with one character per token id keeps the cases readable."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pdserve.common.messages import RequestDelta, TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.text.choice import Absorbed, ChoiceText, choice_seeds

SPLIT = 0  # a token that is half a character: decodes to U+FFFD


class CharDecoder:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join("\ufffd" if i == SPLIT else chr(i) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def delta(text: str, finish_reason: str | None = None, **fields) -> RequestDelta:
    return RequestDelta("r", ids(text), 0, finish_reason=finish_reason, **fields)


def choice(**params) -> ChoiceText:
    return ChoiceText.for_params(CharDecoder(), SamplingParams(**params))


def test_text_streams_until_the_engine_finishes() -> None:
    c = choice()
    assert c.absorb(delta("Hel", num_cached_tokens=2)) == Absorbed("Hel")
    assert not c.finished and c.num_cached_tokens == 2
    assert c.absorb(delta("lo", "length", stop_reason=None)) == Absorbed("lo", "length")
    assert (c.stream.text, c.token_ids, c.finish_reason) == ("Hello", ids("Hello"), "length")
    assert c.logprobs is None


def test_a_stop_string_ends_the_choice_and_the_request() -> None:
    c = choice(stop=["lo"])
    assert c.absorb(delta("Hel")) == Absorbed("He")  # "l" may start "lo": held back
    assert c.absorb(delta("lo w")) == Absorbed("l", "stop", end_request=True)
    assert (c.stream.text, c.finish_reason, c.stop_reason) == ("Hel", "stop", "lo")
    # What the engine made before it heard is dropped.
    assert c.absorb(delta("orld", "length")) == Absorbed("")
    assert c.token_ids == ids("Hello w") and c.finish_reason == "stop"


def test_held_back_text_comes_out_with_the_last_delta() -> None:
    c = choice(stop=["xyz"], include_stop_str_in_output=False)
    assert c.absorb(delta("abx")) == Absorbed("ab")
    assert c.absorb(delta("y", "stop", stop_reason=2)) == Absorbed("xy", "stop")
    assert (c.stream.text, c.stop_reason) == ("abxy", 2)  # the engine's stop token


def test_text_flushed_at_the_end_may_complete_a_stop_string() -> None:
    c = choice(stop=["a\ufffd"])
    end = RequestDelta("r", [SPLIT], 1, finish_reason="length")
    assert c.absorb(delta("a")) == Absorbed("")
    # The engine already finished: nothing to end there.
    assert c.absorb(end) == Absorbed("", "stop", end_request=False)
    assert (c.finish_reason, c.stop_reason) == ("stop", "a\ufffd")


def test_logprobs_are_kept_when_asked_for() -> None:
    c = choice(logprobs=0)
    first, second = TokenLogprobs(ord("a"), -0.5, 1), TokenLogprobs(ord("b"), -1.5, 2)
    c.absorb(delta("a", logprobs=[first]))
    c.absorb(delta("b", "length", logprobs=[second]))
    assert c.logprobs == [first, second]


def test_choice_seeds() -> None:
    assert choice_seeds(7, 3) == [7, 8, 9]
    assert choice_seeds(7, 2, random.Random(0)) == [7, 8]  # a seed wins over the generator
    assert choice_seeds(None, 2) == [None, None]  # the engine draws them
    drawn, again = choice_seeds(None, 3, random.Random(0)), random.Random(0)
    assert drawn == [again.getrandbits(63) for _ in range(3)] and len(set(drawn)) == 3
