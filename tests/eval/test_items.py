"""The dataset file: items parsed and checked, mistakes named by line; the shipped set."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from pdserve.eval.dataset import SHIPPED_DATASET, build_items
from pdserve.eval.items import DEFAULT_MAX_TOKENS, load_items


def write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "items.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_items_of_every_kind(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"category": "exact", "prompt": "1, 2,", "answer": ["3", "three"], "stop": ","},
        "",
        {
            "id": "q",
            "category": "facts",
            "kind": "choice",
            "prompt": "?",
            "choices": ["A", "B"],
            "answer": "B",
            "max_tokens": 2,
        },
        {"category": "json", "messages": [{"role": "user", "content": "JSON"}], "keys": ["k"]},
        {"category": "long", "messages": [{"role": "user", "content": "A story."}]},
    )
    exact, choice, as_json, long = load_items(path)
    assert (exact.id, exact.kind, exact.answers, exact.stop) == (
        "line-1",
        "exact",
        ("3", "three"),
        (",",),
    )
    assert exact.max_tokens == DEFAULT_MAX_TOKENS["exact"]
    assert (choice.id, choice.category, choice.kind, choice.answers) == (
        "q",
        "facts",
        "choice",
        ("B",),
    )
    assert choice.max_tokens == 2
    assert as_json.keys == ("k",) and as_json.prompt is None
    assert long.kind == "long" and long.max_tokens == DEFAULT_MAX_TOKENS["long"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "items.jsonl:2: Expecting property name"),
        ('["a list"]', "items.jsonl:2: an item must be a JSON object"),
        ({"category": "trivia", "prompt": "?"}, "kind 'trivia' is not one of"),
        ({"category": "exact", "prompt": "?"}, "'answer' must be a string or a non-empty list"),
        ({"category": "exact", "prompt": "?", "messages": [], "answer": "x"}, "exactly one of"),
        ({"category": "exact", "answer": "x"}, "exactly one of"),
        (
            {"category": "choice", "prompt": "?", "choices": ["A", "B"], "answer": "C"},
            "an 'answer' among them",
        ),
        ({"category": "long", "prompt": "?", "max_tokens": 0}, "'max_tokens' must be a positive"),
        ({"category": "long", "prompt": "?", "temperature": 1}, "unknown field(s) temperature"),
        ({"category": "long", "messages": [{"role": "user"}]}, "'role' and 'content'"),
        ({"id": "a", "category": "long", "prompt": "?"}, "id 'a' appears twice"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, line: object, message: str) -> None:
    path = write(tmp_path, {"id": "a", "category": "long", "prompt": "ok"}, line)
    with pytest.raises(ValueError, match=r"items\.jsonl:2: ") as error:
        load_items(path)
    assert message in str(error.value)


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no items"):
        load_items(write(tmp_path, ""))


def test_the_shipped_dataset_is_its_generator_output() -> None:
    # The file in the repository is exactly what `python -m pdserve.eval.dataset` writes.
    shipped = Path(SHIPPED_DATASET).read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in shipped] == build_items()
    items = load_items(SHIPPED_DATASET)
    counts = Counter(item.category for item in items)
    assert len(items) >= 300
    assert set(counts) == {"choice", "exact", "json", "long"}
    assert min(counts.values()) >= 30
