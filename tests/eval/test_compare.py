"""`pdserve eval compare` end to end against fake servers that answer from tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main

STORY = (
    "Once upon a time a small dragon lived on a hill above a quiet village. Every morning "
    "she watched the farmers walk to their fields and wondered what lay beyond the river."
)
LOOP = "and it was too, " * 40
ITEMS = 10  # per kind: 40 items, one item is 2.5 points


def dataset() -> tuple[list[dict], dict[str, str], dict[str, str]]:
    """Items, the replies that score every item, and replies that score none."""
    items: list[dict] = []
    right: dict[str, str] = {}
    wrong: dict[str, str] = {}
    for i in range(ITEMS):
        prompt = f"{i}, {i + 1},"
        items.append({"category": "exact", "prompt": prompt, "answer": str(i + 2), "stop": ","})
        right[prompt], wrong[prompt] = f" {i + 2}", f" {i + 3}"
        prompt = f"Word {i}: animal or color?"
        items.append(
            {
                "category": "choice",
                "prompt": prompt,
                "choices": ["animal", "color"],
                "answer": "animal",
            }
        )
        right[prompt], wrong[prompt] = " animal", " color"
        prompt = f"Key: k{i}"
        items.append({"category": "json", "prompt": prompt, "keys": [f"k{i}"]})
        right[prompt], wrong[prompt] = f'{{"k{i}": 1}}', f'{{"k{i}": 1'
        prompt = f"Write story {i}."
        items.append({"category": "long", "messages": [{"role": "user", "content": prompt}]})
        right[prompt], wrong[prompt] = STORY, STORY + " " + LOOP
    return items, right, wrong


@pytest.fixture
def setup(table_server, tmp_path: Path):
    items, right, wrong = dataset()
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return table_server, path, right, wrong


def compare(baseline: str, candidate: str, path: Path, *more: str) -> int:
    return main(
        [
            "eval",
            "compare",
            "--baseline",
            baseline,
            "--candidate",
            candidate,
            "--dataset",
            str(path),
            *more,
        ]
    )


def test_same_answers_are_normal(setup, tmp_path: Path, capsys) -> None:
    server, path, right, _ = setup
    baseline = server.serve("base", right)
    candidate = server.serve("same", right)
    out = tmp_path / "result.json"
    assert compare(baseline, candidate, path, "--json", str(out), "--seed", "7") == 0
    text = capsys.readouterr().out
    assert "verdict: normal" in text
    assert "difference: +0.00 pp" in text
    result = json.loads(out.read_text())
    assert result["verdict"] == "normal" and result["drop_pp"] == 0
    assert result["overall"]["baseline"]["percent"] == 100.0
    assert result["candidate"] == {"url": candidate, "model": "same-model"}
    assert result["loops"]["candidate"]["looping"] == 0
    assert len(result["items"]) == 4 * ITEMS
    # Greedy and seeded, the model the server lists first, each item's own limits.
    sent = server.requests("same")
    assert len(sent) == 4 * ITEMS
    for request in sent:
        body = request["body"]
        assert body["temperature"] == 0 and body["seed"] == 7 and body["model"] == "same-model"
    exact = next(r["body"] for r in sent if r["body"].get("prompt") == "0, 1,")
    assert exact["stop"] == [","] and exact["max_tokens"] == 16
    chat = [r["body"] for r in sent if "messages" in r["body"]]
    assert len(chat) == ITEMS and all(b["max_tokens"] == 256 for b in chat)


def test_a_broken_candidate_is_rolled_back(setup, tmp_path: Path, capsys) -> None:
    server, path, right, wrong = setup
    baseline = server.serve("base", right)
    candidate = server.serve("broken", wrong)
    out = tmp_path / "result.json"
    assert compare(baseline, candidate, path, "--json", str(out)) == 3
    text = capsys.readouterr().out
    assert "verdict: roll back to a less aggressive format" in text
    assert f"long generations that loop: candidate {ITEMS} of {ITEMS}, baseline 0" in text
    result = json.loads(out.read_text())
    for row in result["categories"].values():
        assert row["delta_pp"] == -100.0
    assert result["drop_pp"] == 100.0


def test_one_category_slipping_asks_to_look(setup, capsys) -> None:
    server, path, right, _ = setup
    baseline = server.serve("base", right)
    candidate = server.serve("slips", {**right, "Key: k3": '{"k3": '})
    assert compare(baseline, candidate, path) == 1
    text = capsys.readouterr().out
    assert "difference: -2.50 pp" in text
    assert "verdict: look at the categories" in text
    json_row = next(line for line in text.splitlines() if line.startswith("json"))
    assert json_row.split()[-2:] == ["-10.0", "<-"]  # the category to look at


def test_api_keys_and_model_names(setup, capsys) -> None:
    server, path, right, _ = setup
    baseline = server.serve("keyed-a", right, api_key="key-a")
    candidate = server.serve("keyed-b", right, api_key="key-b")
    keys = ("--api-key", "key-a", "--candidate-api-key", "key-b")
    assert compare(baseline, candidate, path, *keys, "--candidate-model", "named") == 0
    assert {r["authorization"] for r in server.requests("keyed-b")} == {"Bearer key-b"}
    assert {r["body"]["model"] for r in server.requests("keyed-b")} == {"named"}
    assert {r["body"]["model"] for r in server.requests("keyed-a")} == {"keyed-a-model"}
    # --model names the model on both sides; a side's own name wins.
    baseline = server.serve("keyed-a", right, api_key="key-a")
    candidate = server.serve("keyed-b", right, api_key="key-b")
    assert compare(baseline, candidate, path, *keys, "--model", "m", "--baseline-model", "a") == 0
    assert {r["body"]["model"] for r in server.requests("keyed-b")} == {"m"}
    assert {r["body"]["model"] for r in server.requests("keyed-a")} == {"a"}
    # Without its key a server answers 401: the run stops with one line saying so.
    assert compare(baseline, candidate, path, "--api-key", "key-a") == 2
    assert "401 Unauthorized" in one_line_error(capsys)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("pdserve eval compare: error: ")
    return err


def test_bad_input_is_one_line(setup, tmp_path: Path, refused_url: str, capsys) -> None:
    server, path, right, _ = setup
    good = server.serve("base", right)
    assert compare(good, refused_url, path) == 2
    assert f"{refused_url}/v1/models: ConnectError" in one_line_error(capsys)
    # With the model named nothing asks /v1/models: every request fails instead.
    assert compare(good, refused_url, path, "--candidate-model", "m") == 2
    assert "every request failed on a server" in one_line_error(capsys)
    assert compare(good, good, tmp_path / "missing.jsonl") == 2
    assert "missing.jsonl" in one_line_error(capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "exact", "prompt": "x"}\n')
    assert compare(good, good, bad) == 2
    assert "bad.jsonl:1: 'answer'" in one_line_error(capsys)
    with pytest.raises(SystemExit):
        main(["eval", "compare", "--baseline", good, "--candidate", good, "--request-timeout", "0"])
    assert "must be above 0" in capsys.readouterr().err
