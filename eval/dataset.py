"""The shipped dataset of `pdserve eval compare`, made for SmolLM2-135M-Instruct: easy
items (few-shot completions, which so small a model follows better than instructions)
built from the word lists in `eval/words.py`, in a fixed order, with no download.

    python -m pdserve.eval.dataset [OUT.jsonl]   # rewrites the shipped file by default

Categories: `choice` (classify a word, the sentiment of a review), `exact` (count on,
add, opposites, capitals, plurals), `json` (one object with the keys asked for), `long`
(stories of 200 tokens, checked for repetition loops).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from pdserve.eval import words

SHIPPED_DATASET = str(Path(__file__).resolve().parent / "data" / "smollm2_quality.jsonl")
SEED = 20251201
LONG_TOKENS = 200


def choice_items(rng: random.Random) -> Iterator[dict]:
    for name, classes in words.CLASSES.items():
        labels = list(classes)
        header = f"Sort each word: {', '.join(labels[:-1])} or {labels[-1]}.\n"
        shots = "".join(
            f"{classes[label][shot]}: {label}\n"
            for shot in range(words.SHOTS_PER_CLASS)
            for label in labels
        )
        for label in labels:
            for word in classes[label][words.SHOTS_PER_CLASS :]:
                yield {
                    "id": f"choice-{name.replace('/', '-')}-{word}",
                    "prompt": header + shots + f"{word}:",
                    "choices": labels,
                    "answer": label,
                    "stop": ["\n"],
                    "max_tokens": 4,
                }
    shots = (
        "Review: The food was amazing\nSentiment: positive\n"
        "Review: The film was boring\nSentiment: negative\n"
        "Review: I really enjoyed it\nSentiment: positive\n"
        "Review: It broke after one day\nSentiment: negative\n"
    )
    for thing in words.REVIEWED:
        for adjectives, label in ((words.GOOD, "positive"), (words.BAD, "negative")):
            adjective = rng.choice(adjectives)
            yield {
                "id": f"choice-sentiment-{thing}-{label}",
                "prompt": shots + f"Review: The {thing} was {adjective}\nSentiment:",
                "choices": ["positive", "negative"],
                "answer": label,
                "stop": ["\n"],
                "max_tokens": 4,
            }


def _exact(id_: str, prompt: str, answer: str, stop: list[str]) -> dict:
    return {"id": id_, "prompt": prompt, "answer": answer, "stop": stop, "max_tokens": 6}


def exact_items(rng: random.Random) -> Iterator[dict]:
    for start in rng.sample(range(2, 90), 20):
        prompt = f"{start}, {start + 1}, {start + 2},"
        yield _exact(f"exact-count-{start}", prompt, str(start + 3), [",", "\n"])
    numbers = words.NUMBER_WORDS
    for start in range(len(numbers) - 3):
        prompt = ", ".join(numbers[start : start + 3]) + ","
        yield _exact(f"exact-words-{numbers[start]}", prompt, numbers[start + 3], [",", "\n"])
    shots = "1 + 1 = 2\n2 + 3 = 5\n4 + 2 = 6\n3 + 3 = 6\n"
    pairs = [(a, b) for a in range(1, 6) for b in range(1, 5)]
    for a, b in rng.sample(pairs, 20):
        yield _exact(f"exact-add-{a}-{b}", shots + f"{a} + {b} =", str(a + b), ["\n"])
    shots = "Opposite of tall: short\nOpposite of rich: poor\nOpposite of loud: quiet\n"
    for word, opposite in words.ANTONYMS:
        yield _exact(f"exact-opposite-{word}", shots + f"Opposite of {word}:", opposite, ["\n"])
    shots = "The capital of Canada is Ottawa.\nThe capital of Peru is Lima.\n"
    for country, city in words.CAPITALS:
        prompt = shots + f"The capital of {country} is"
        yield _exact(f"exact-capital-{country}", prompt, city, ["\n", "."])
    shots = "Singular: pen\nPlural: pens\nSingular: chair\nPlural: chairs\n"
    for one, many in words.PLURALS:
        prompt = shots + f"Singular: {one}\nPlural:"
        yield _exact(f"exact-plural-{one}", prompt, many, ["\n"])


def json_items(rng: random.Random) -> Iterator[dict]:
    shots = (
        'Make a JSON object.\nKey: size, value: big\nJSON: {"size": "big"}\n'
        'Key: pet, value: cat\nJSON: {"pet": "cat"}\n'
    )
    for key in words.JSON_KEYS:
        for value in rng.sample(words.JSON_VALUES, 4):
            yield {
                "id": f"json-pair-{key}-{value}",
                "prompt": shots + f"Key: {key}, value: {value}\nJSON:",
                "keys": [key],
                "stop": ["\n"],
                "max_tokens": 16,
            }
    shots = 'Point (1, 2) as JSON: {"x": 1, "y": 2}\nPoint (5, 3) as JSON: {"x": 5, "y": 3}\n'
    points = [(x, y) for x in range(1, 10) for y in range(1, 10)]
    for x, y in rng.sample(points, 24):
        yield {
            "id": f"json-point-{x}-{y}",
            "prompt": shots + f"Point ({x}, {y}) as JSON:",
            "keys": ["x", "y"],
            "stop": ["\n"],
            "max_tokens": 16,
        }
    values = rng.sample(words.JSON_VALUES * 3, 3 * len(words.JSON_KEYS))
    for key, value in zip(words.JSON_KEYS * 3, values, strict=True):
        ask = f'Reply with a JSON object that has the key "{key}" set to "{value}". '
        yield {
            "id": f"json-chat-{key}-{value}",
            "messages": [{"role": "user", "content": ask + "Reply with JSON only."}],
            "keys": [key],
            "max_tokens": 32,
        }


def long_items() -> Iterator[dict]:
    for hero in words.STORY_HEROES:
        for plot in words.STORY_PLOTS:
            ask = f"Write a long story about {hero} {plot}."
            yield {
                "id": f"long-{hero.split()[-1]}-{plot.split()[-1]}",
                "messages": [{"role": "user", "content": ask}],
                "max_tokens": LONG_TOKENS,
            }


def build_items() -> list[dict]:
    """Every item, in a fixed order (the same list on every run and machine)."""
    rng = random.Random(SEED)
    made = {
        "choice": list(choice_items(rng)),
        "exact": list(exact_items(rng)),
        "json": list(json_items(rng)),
        "long": list(long_items()),
    }
    return [{"category": category, **item} for category, items in made.items() for item in items]


def write_dataset(path: str | Path) -> int:
    items = build_items()
    lines = (json.dumps(item, ensure_ascii=False) + "\n" for item in items)
    Path(path).write_text("".join(lines), encoding="utf-8")
    return len(items)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else SHIPPED_DATASET
    print(f"{write_dataset(out)} items in {out}")
