"""Incremental detokenization (split multi-byte characters held back, deltas adding up to the
full decode) and stop strings that span deltas, on the embedded model's byte-level tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.text.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextStream
from pdserve.text.tokenizer import Tokenizer

TEXTS = [
    "Emoji 😀🎉 and a family 👨‍👩‍👧 in a row.",
    "日本語のテキスト、中文字符。한국어 문장.",
    "naïve café — “quotes” and ½ ² ٣",
    "<|im_start|>user\nmixed 🇫🇷 flags<|im_end|>",
]


def stream_deltas(tokenizer: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special)
    deltas = [detok.add_tokens([token]) for token in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def test_split_characters_are_held_until_complete(tokenizer: Tokenizer) -> None:
    held_somewhere = False
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = stream_deltas(tokenizer, ids, skip_special=False)
        assert "".join(deltas) == text == tokenizer.decode(ids, skip_special_tokens=False)
        assert not any("\ufffd" in delta for delta in deltas)
        held_somewhere |= "" in deltas[:-1]
        # Each step's text really is only what that token completed.
        emitted = ""
        for count, delta in enumerate(deltas[:-1], start=1):
            emitted += delta
            assert tokenizer.decode(ids[:count], skip_special_tokens=False).startswith(emitted)
    assert held_somewhere  # the emoji and CJK texts do split characters across tokens


def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi 😀<|im_end|>", add_special_tokens=False)
    assert "".join(stream_deltas(tokenizer, ids)) == "assistant\nHi 😀"
    kept = "".join(stream_deltas(tokenizer, ids, skip_special=False))
    assert kept == "<|im_start|>assistant\nHi 😀<|im_end|>"


def test_a_character_that_never_completes_comes_out_on_flush(tokenizer: Tokenizer) -> None:
    lead_byte = tokenizer.encode("😀", add_special_tokens=False)[0]  # starts a 4-byte sequence
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens([lead_byte]) == ""
    assert detok.flush() == "\ufffd" == tokenizer.decode([lead_byte])
    # A later complete token releases the broken byte together with itself.
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens([lead_byte]) == ""
    tail = tokenizer.encode("ok", add_special_tokens=False)
    assert detok.add_tokens(tail) == tokenizer.decode([lead_byte, *tail]) == "\ufffdok"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=40),
    cuts=st.lists(st.integers(min_value=1, max_value=4), min_size=40, max_size=40),
    skip_special=st.booleans(),
)
def test_deltas_add_up_to_the_full_decode(tokenizer, ids, cuts, skip_special) -> None:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special)
    text, start = "", 0
    for size in cuts:
        if start >= len(ids):
            break
        text += detok.add_tokens(ids[start : start + size])
        start += size
    text += detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special)


# ---- stop strings ------------------------------------------------------------------------------


def run_stream(tokenizer: Tokenizer, text: str, stop: list[str], include: bool):
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, stop=stop, include_stop_str_in_output=include)
    shown = []
    for token in ids:
        delta = stream.add_tokens([token])
        shown.append(delta.text)
        if delta.stopped:
            break
    else:
        shown.append(stream.finish().text)
    assert stream.text == "".join(shown)
    return stream, shown


def test_stop_string_across_tokens_is_cut_and_never_shown_in_part(tokenizer: Tokenizer) -> None:
    text = "Counting: one, two, three. Done 😀 really."
    stop = ["three.", "nothing"]
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "three." not in pieces  # the stop string spans several tokens
    stream, shown = run_stream(tokenizer, text, stop, include=False)
    assert stream.stopped and stream.stop_string == "three."
    assert stream.text == "Counting: one, two, "
    assert not any("th" in piece for piece in shown)  # no partial stop string ever streamed
    stream, _ = run_stream(tokenizer, text, stop, include=True)
    assert stream.text == "Counting: one, two, three."


def test_stop_string_inside_a_multibyte_character_run(tokenizer: Tokenizer) -> None:
    stream, _ = run_stream(tokenizer, "Smile 😀🎉 party", ["🎉"], include=False)
    assert stream.text == "Smile 😀" and stream.stop_string == "🎉"
    stream, _ = run_stream(tokenizer, "Smile 😀🎉 party", ["😀🎉 p"], include=True)
    assert stream.text == "Smile 😀🎉 p"


def test_held_text_is_released_when_no_stop_completes(tokenizer: Tokenizer) -> None:
    stream, shown = run_stream(tokenizer, "almost the end", ["end.", "the endgame"], include=False)
    assert not stream.stopped and stream.text == "almost the end"
    assert shown[-1].endswith("end")  # held back until finish() released it


def test_matcher_reports_first_completed_and_stays_stopped() -> None:
    matcher = StopStringMatcher(["abc", "b"], include_stop_str_in_output=False)
    assert matcher.feed("xa").text == "x"  # "a" could start "abc"
    delta = matcher.feed("bc")
    assert delta.stopped and delta.stop_string == "b" and delta.text == "a"
    assert matcher.feed("more").text == "" and matcher.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def reference_cut(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Cut `text` at the stop string that is completed first, reading left to right."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            found = max(done, key=len)
            return (text[:end] if include else text[: end - len(found)]), found
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n😀", max_size=30),
    stop=st.lists(st.text(alphabet="ab\n😀", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=5), min_size=30, max_size=30),
    include=st.booleans(),
)
def test_matcher_is_independent_of_how_text_is_cut(text, stop, cuts, include) -> None:
    matcher = StopStringMatcher(stop, include_stop_str_in_output=include)
    released, start = "", 0
    for size in [*cuts, len(text)]:
        delta = matcher.feed(text[start : start + size])
        start += size
        released += delta.text
        if not include and not delta.stopped:
            assert not any(s in released for s in stop)  # nothing shown that will be cut
        if delta.stopped:
            break
    else:
        released += matcher.flush()
    expected, found = reference_cut(text, stop, include)
    assert released == expected
    assert matcher.stop_string == found and matcher.stopped == (found is not None)


def test_stream_without_stop_strings_equals_detokenizer(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    stream = TextStream(tokenizer)
    text = "".join(stream.add_tokens([i]).text for i in ids) + stream.finish().text
    assert text == TEXTS[0] and not stream.stopped


def test_sentencepiece_style_decoder_keeps_word_spaces() -> None:
    # Metaspace decoders drop the space of the first token they decode; each step decodes a
    # window that starts mid-text, and the deltas must still carry the spaces between words.
    from tokenizers import SentencePieceBPETokenizer

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, zoë and café"] * 20
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(corpus, vocab_size=120, min_frequency=1, show_progress=False)
    tokenizer = Tokenizer(trained._tokenizer)
    text = "the lazy fox says hello, café world"
    ids = tokenizer.encode(text)
    deltas = stream_deltas(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert sum(delta.startswith(" ") for delta in deltas) >= 5
