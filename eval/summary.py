"""Scores of two servers' replies to the same items: per category, overall, the drop in
percentage points, the verdict and the long generations that loop.

Every item scores 1 or 0: an exact item matches an answer, a choice item names the right
choice, a json item is valid JSON (with its keys), a long item does not loop. An item
whose request failed on either server is left out of both sides' scores (and listed),
so the two sides are always scored on the same items.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.eval.client import Reply
from pdserve.eval.items import EvalItem
from pdserve.eval.scoring import exact_match, extract_choice, json_valid, loop_ratio, loops
from pdserve.eval.verdict import percent, verdict

SIDES = ("baseline", "candidate")


def score(item: EvalItem, text: str) -> bool:
    """Whether one reply to `item` is right by its kind's rule."""
    if item.kind == "exact":
        return exact_match(text, item.answers)
    if item.kind == "choice":
        return extract_choice(text, item.choices) == item.answers[0]
    if item.kind == "json":
        return json_valid(text, item.keys)
    return not loops(text)


def item_record(item: EvalItem, replies: dict[str, Reply]) -> dict:
    record: dict = {"id": item.id, "category": item.category, "kind": item.kind}
    for side in SIDES:
        reply = replies[side]
        entry: dict = {"text": reply.text, "finish_reason": reply.finish_reason}
        if reply.error is not None:
            entry["error"] = reply.error
        else:
            entry["correct"] = score(item, reply.text)
            if item.kind == "long":
                entry["loop_ratio"] = round(loop_ratio(reply.text), 4)
        record[side] = entry
    return record


def tally(records: Sequence[dict]) -> dict:
    """Per category and overall: items, each side's correct count and percentage, and the
    candidate's difference in points (negative: the candidate is worse)."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["category"], []).append(record)
    table = {name: _row(group) for name, group in sorted(groups.items())}
    return {"categories": table, "overall": _row(records)}


def _row(records: Sequence[dict]) -> dict:
    row: dict = {"items": len(records)}
    for side in SIDES:
        correct = sum(1 for record in records if record[side]["correct"])
        row[side] = {"correct": correct, "percent": percent(correct, len(records))}
    row["delta_pp"] = row["candidate"]["percent"] - row["baseline"]["percent"]
    return row


def loop_counts(records: Sequence[dict]) -> dict:
    """How many long generations loop on each side, and which."""
    long = [record for record in records if record["kind"] == "long"]
    counts: dict = {"long_items": len(long)}
    for side in SIDES:
        ids = [record["id"] for record in long if not record[side]["correct"]]
        counts[side] = {"looping": len(ids), "ids": ids}
    return counts


def summarize(items: Sequence[EvalItem], replies: dict[str, Sequence[Reply]]) -> dict:
    """The comparison of `replies["baseline"]` and `replies["candidate"]` (one per item,
    in the items' order)."""
    records = [
        item_record(item, {side: replies[side][i] for side in SIDES})
        for i, item in enumerate(items)
    ]
    failed = [r for r in records if any("error" in r[side] for side in SIDES)]
    scored = [r for r in records if r not in failed]
    left_out = [
        {"id": r["id"], **{side: r[side]["error"] for side in SIDES if "error" in r[side]}}
        for r in failed
    ]
    if not scored:
        first = left_out[0]
        reason = first.get("candidate") or first.get("baseline")
        raise ValueError(f"every request failed on a server; the first said: {reason}")
    summary = tally(scored)
    drop = -summary["overall"]["delta_pp"]
    return {
        **summary,
        "drop_pp": drop,
        "verdict": verdict(drop),
        "loops": loop_counts(scored),
        "left_out": left_out,
        "items": records,
    }
