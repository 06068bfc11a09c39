"""The text `pdserve eval compare` prints: a table per category, the overall difference,
the long generations that loop, and the verdict with its bands."""

from __future__ import annotations

from pdserve.eval.verdict import LOOK_PP, NORMAL_PP

BANDS = (
    f"<= {NORMAL_PP:g} pp normal; {NORMAL_PP:g}-{LOOK_PP:g} pp look at the categories; "
    f"> {LOOK_PP:g} pp roll back to a less aggressive format"
)
# A category whose own drop passes this many points is marked in the table.
FLAG_PP = LOOK_PP


def _line(name: str, row: dict) -> str:
    mark = "  <-" if -row["delta_pp"] > FLAG_PP else ""
    return (
        f"{name:<16}{row['items']:>6}{row['baseline']['percent']:>13.1f}"
        f"{row['candidate']['percent']:>13.1f}{row['delta_pp']:>+10.1f}{mark}"
    )


def format_report(result: dict) -> str:
    lines = [
        "=" * 20 + " Quality comparison " + "=" * 20,
        f"baseline:  {result['baseline']['model']} at {result['baseline']['url']}",
        f"candidate: {result['candidate']['model']} at {result['candidate']['url']}",
        f"temperature 0, seed {result['seed']}",
        "",
        f"{'category':<16}{'items':>6}{'baseline %':>13}{'candidate %':>13}{'diff pp':>10}",
    ]
    lines += [_line(name, row) for name, row in result["categories"].items()]
    lines.append(_line("overall", result["overall"]))
    if any(-row["delta_pp"] > FLAG_PP for row in result["categories"].values()):
        lines.append(f"<-: the category dropped more than {FLAG_PP:g} pp")
    lines.append("")
    loops = result["loops"]
    if loops["long_items"]:
        lines.append(
            f"long generations that loop: candidate {loops['candidate']['looping']} of "
            f"{loops['long_items']}, baseline {loops['baseline']['looping']}"
        )
    if result["left_out"]:
        first = result["left_out"][0]
        reason = first.get("candidate") or first.get("baseline")
        lines.append(
            f"left out: {len(result['left_out'])} items whose request failed "
            f"(first: {first['id']}: {reason})"
        )
    lines += [
        f"difference: {result['overall']['delta_pp']:+.2f} pp (candidate - baseline)",
        f"bands: {BANDS}",
        f"verdict: {result['verdict']}",
    ]
    return "\n".join(lines)
