"""The dataset of `pdserve eval compare`: JSON lines, one item each.

    {"id": "exact-17", "category": "exact", "prompt": "2, 3, 4,", "answer": "5",
     "stop": [","], "max_tokens": 4}
    {"category": "choice", "messages": [{"role": "user", "content": "..."}],
     "choices": ["A", "B", "C", "D"], "answer": "C"}
    {"category": "json", "prompt": "...", "keys": ["color"]}
    {"category": "long", "messages": [...], "max_tokens": 256}

`prompt` goes to `/v1/completions`, `messages` to `/v1/chat/completions`. `kind` says how
the reply scores (exact, choice, json, long); without it the category names the kind.
`answer` may be a list of accepted answers for exact items. Every mistake in the file is
a `ValueError` naming its line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("exact", "choice", "json", "long")
DEFAULT_MAX_TOKENS = {"exact": 16, "choice": 8, "json": 64, "long": 256}
_FIELDS = {
    "id",
    "category",
    "kind",
    "prompt",
    "messages",
    "answer",
    "choices",
    "keys",
    "stop",
    "max_tokens",
}


@dataclass(frozen=True)
class EvalItem:
    id: str
    category: str
    kind: str
    max_tokens: int
    prompt: str | None = None  # completions
    messages: list[dict[str, str]] | None = None  # chat
    answers: tuple[str, ...] = ()  # exact: any of them; choice: the right choice
    choices: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()  # json: the object must have them
    stop: tuple[str, ...] = field(default=())


def _strings(value: object, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"'{name}' must be a string or a non-empty list of strings")


def _messages(value: object) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list")
    for message in value:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError("each message needs a string 'role' and 'content'")
    return value


def _kind_fields(raw: dict, kind: str) -> dict:
    """The scoring fields of one kind, checked."""
    if kind == "exact":
        return {"answers": _strings(raw.get("answer"), "answer")}
    if kind == "choice":
        choices = _strings(raw.get("choices"), "choices")
        answer = raw.get("answer")
        if len(choices) < 2 or answer not in choices:
            raise ValueError("a choice item needs 2+ 'choices' and an 'answer' among them")
        return {"choices": choices, "answers": (answer,)}
    if kind == "json":
        return {"keys": _strings(raw["keys"], "keys") if "keys" in raw else ()}
    return {}


def parse_item(raw: object, number: int) -> EvalItem:
    """One line's object as an item; `number` names it when it has no `id`."""
    if not isinstance(raw, dict):
        raise ValueError("an item must be a JSON object")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    category = raw.get("category")
    if not isinstance(category, str) or not category:
        raise ValueError("'category' must be a non-empty string")
    kind = raw.get("kind", category)
    if kind not in KINDS:
        raise ValueError(f"kind '{kind}' is not one of {', '.join(KINDS)} (set 'kind')")
    if ("prompt" in raw) == ("messages" in raw):
        raise ValueError("an item needs exactly one of 'prompt' and 'messages'")
    if "prompt" in raw and not isinstance(raw["prompt"], str):
        raise ValueError("'prompt' must be a string")
    max_tokens = raw.get("max_tokens", DEFAULT_MAX_TOKENS[kind])
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError("'max_tokens' must be a positive integer")
    return EvalItem(
        id=str(raw.get("id", f"line-{number}")),
        category=category,
        kind=kind,
        max_tokens=max_tokens,
        prompt=raw.get("prompt"),
        messages=_messages(raw["messages"]) if "messages" in raw else None,
        stop=_strings(raw["stop"], "stop") if "stop" in raw else (),
        **_kind_fields(raw, kind),
    )


def load_items(path: str | Path) -> list[EvalItem]:
    """Every item of a JSONL file (blank lines skipped); ids must be unique."""
    items: list[EvalItem] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                item = parse_item(json.loads(line), number)
            except ValueError as exc:  # json.JSONDecodeError is one
                raise ValueError(f"{path}:{number}: {exc}") from None
            if item.id in seen:
                raise ValueError(f"{path}:{number}: id '{item.id}' appears twice")
            seen.add(item.id)
            items.append(item)
    if not items:
        raise ValueError(f"{path}: no items")
    return items
