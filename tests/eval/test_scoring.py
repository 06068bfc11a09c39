"""Each scoring rule of `pdserve eval compare` on replies a model really gives."""

from __future__ import annotations

import pytest

from pdserve.eval.scoring import (
    exact_match,
    extract_choice,
    json_valid,
    loop_ratio,
    loops,
    normalize_answer,
    repeated_ngram_ratio,
)


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("  Paris. ", "paris"),
        ("The Eiffel  Tower!", "eiffel tower"),
        ("An apple", "apple"),
        ("\uff11\uff12", "12"),  # full-width digits (NFKC)
        ("Rock-n-roll", "rocknroll"),
        ("\nfive\n", "five"),
    ],
)
def test_normalize_answer(text: str, normal: str) -> None:
    assert normalize_answer(text) == normal


def test_exact_match_after_normalisation_and_aliases() -> None:
    assert exact_match(" Paris.", ["paris"])
    assert exact_match("the USA", ["United States", "USA"])
    assert not exact_match("Paris, France", ["Paris"])  # exact: no partial credit
    assert not exact_match("", ["5"])
    assert not exact_match("15", ["5"])


LETTERS = ["A", "B", "C", "D"]


@pytest.mark.parametrize(
    ("reply", "choice"),
    [
        ("B", "B"),
        (" B.", "B"),
        ("(C)", "C"),
        ("Answer: D", "D"),
        ("The answer is C. cow", "C"),
        ("a cat is not an answer, B is", "B"),  # lower-case "a" is not the letter A
        ("Banana", None),  # the B of a word is not a choice
        ("none of them", None),
        ("", None),
    ],
)
def test_extract_choice_by_letter(reply: str, choice: str | None) -> None:
    assert extract_choice(reply, LETTERS) == choice


@pytest.mark.parametrize(
    ("reply", "choice"),
    [
        (" animal", "animal"),
        ("Fruit", "fruit"),
        ("It is a fruit, not an animal", "fruit"),  # the first named wins
        ("colorful", None),  # whole words only
        ("New York City", "New York"),  # the longer choice at one position
        ("new", "New"),
    ],
)
def test_extract_choice_by_text(reply: str, choice: str | None) -> None:
    choices = ["animal", "color", "fruit", "New", "New York"]
    assert extract_choice(reply, choices) == choice


@pytest.mark.parametrize(
    ("reply", "keys", "valid"),
    [
        (' {"color": "red"}', ["color"], True),
        ('```json\n{"color": "red"}\n```', ["color"], True),
        ('```\n{"x": 1, "y": 2}\n```', ["x", "y"], True),
        ('{"color": "red"', ["color"], False),  # cut off
        ('{"color": "red"} and more', ["color"], False),  # more than one value
        ('{"name": "red"}', ["color"], False),  # the key asked for is missing
        ('["color"]', ["color"], False),  # not an object
        ("[1, 2]", [], True),
        ("{'color': 'red'}", [], False),  # Python, not JSON
        ("", [], False),
    ],
)
def test_json_valid(reply: str, keys: list[str], valid: bool) -> None:
    assert json_valid(reply, keys) is valid


PROSE = (
    "Once upon a time a small dragon lived on a hill above a quiet village. Every "
    "morning she watched the farmers walk to their fields and wondered what lay beyond "
    "the river. One day a traveller told her about a secret door in the old forest, "
    "hidden behind a curtain of ivy, and she decided to find it before winter came."
)
LOOP = "He was a giant of a giant. He had a massive head and a massive body. " * 8


def test_repeated_ngram_ratio() -> None:
    assert repeated_ngram_ratio("a b c d e f") == 0.0
    assert repeated_ngram_ratio("a b a b a b", n=2) == pytest.approx(1 - 2 / 5)
    assert repeated_ngram_ratio("too short", n=4) == 0.0


def test_loops_finds_a_loop_and_not_prose() -> None:
    assert loop_ratio(PROSE) < 0.05
    assert not loops(PROSE)
    assert loop_ratio(LOOP) > 0.8
    assert loops(LOOP)
    # Prose that falls into a loop half-way loops.
    assert loops(PROSE + " " + "and it was too, " * 30)


def test_short_replies_never_loop_and_spaceless_loops_are_found() -> None:
    assert not loops("yes yes yes yes yes")  # too few n-grams to judge
    assert loops("!" * 300)  # no words: judged by characters
    assert loops("猫が好きです。" * 40)
    assert not loops("".join(chr(0x4E00 + i) for i in range(300)))
