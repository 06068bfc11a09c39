"""How one reply scores: exact match, the choice it names, JSON validity, repetition loops.

Each function looks at one reply and nothing else, so the baseline's and the candidate's
replies to an item are judged by the same rule.
"""

from __future__ import annotations

import json
import re
import string
import unicodedata
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_FENCE = re.compile(r"^```[A-Za-z]*\s*\n?(.*?)\n?\s*```$", re.DOTALL)

# A long generation loops when at least this share of its word 4-grams repeat an earlier
# one. Ordinary prose of a few hundred words repeats a few percent; a loop, most of them.
LOOP_NGRAM = 4
LOOP_RATIO = 0.3
# Fewer n-grams than this say nothing about a loop (a short reply is not a loop).
LOOP_MIN_NGRAMS = 16
# Characters per n-gram when a text has too few words to judge by words.
LOOP_CHARS = 8


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's normalisation)."""
    text = unicodedata.normalize("NFKC", text).lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(reply: str, answers: Sequence[str]) -> bool:
    """The reply equals one of the answers once both are normalised."""
    got = normalize_answer(reply)
    return any(got == normalize_answer(answer) for answer in answers)


def _choice_pattern(choice: str) -> re.Pattern[str]:
    # A one-character choice ("B", "7") matches as written: "a cat" must not read as "A".
    flags = 0 if len(choice) == 1 else re.IGNORECASE
    return re.compile(rf"(?<!\w){re.escape(choice)}(?!\w)", flags)


def extract_choice(reply: str, choices: Sequence[str]) -> str | None:
    """The choice the reply names first, as a whole word ("B", "B.", "(B)", "The answer is
    cow"); at one position the longer choice wins ("New York" over "New"). None when the
    reply names none."""
    text = unicodedata.normalize("NFKC", reply)
    best: tuple[int, int, str] | None = None
    for choice in choices:
        found = _choice_pattern(choice).search(text)
        if found is None:
            continue
        key = (found.start(), -len(choice), choice)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def strip_fence(reply: str) -> str:
    """The reply without surrounding whitespace and one Markdown code fence around it."""
    text = reply.strip()
    fenced = _FENCE.match(text)
    return fenced.group(1).strip() if fenced else text


def json_valid(reply: str, keys: Sequence[str] = ()) -> bool:
    """The whole reply (a code fence aside) is one JSON value; with `keys`, an object that
    has every one of them."""
    try:
        value = json.loads(strip_fence(reply))
    except ValueError:
        return False
    if not keys:
        return True
    return isinstance(value, dict) and all(key in value for key in keys)


def _ngrams(units: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]


def repeated_ngram_ratio(text: str, n: int = LOOP_NGRAM) -> float:
    """The share of the text's word n-grams that repeat an earlier one (0 when it has
    none)."""
    grams = _ngrams(text.split(), n)
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def loop_ratio(text: str) -> float:
    """`repeated_ngram_ratio` over words, or over characters (runs of `LOOP_CHARS`) when
    the text has too few words to judge: a loop of punctuation or of a script written
    without spaces."""
    if len(text.split()) - LOOP_NGRAM + 1 >= LOOP_MIN_NGRAMS:
        return repeated_ngram_ratio(text)
    grams = _ngrams(list(text), LOOP_CHARS)
    if len(grams) < LOOP_MIN_NGRAMS * LOOP_CHARS:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def loops(text: str, threshold: float = LOOP_RATIO) -> bool:
    """A long generation that went round in circles: at least `threshold` of its n-grams
    repeat an earlier one (a reply too short to judge never loops)."""
    return loop_ratio(text) >= threshold
