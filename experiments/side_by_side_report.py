"""What `experiments.side_by_side` keeps of each run and how it reports them: per
request TPOT beside the chunk gaps, medians over rounds, ratios to a baseline, and the
table."""

from __future__ import annotations

import statistics

# (key in a measurement, column title, whether a ratio to the baseline is shown)
COLUMNS = (
    ("output_throughput", "out tok/s", True),
    ("median_ttft_ms", "TTFT p50 ms", True),
    ("median_request_tpot_ms", "TPOT p50 ms", True),
    ("median_itl_ms", "ITL p50 ms", False),
    ("tokens_per_chunk", "tok/chunk", False),
    ("failed", "failed req, all rounds", False),
)


def request_tpots_ms(result: dict) -> list[float]:
    """Each request's (last token time - first token time) / (tokens - 1), in ms; the
    time between its first and last chunk is the sum of its chunk gaps."""
    tpots = []
    for gaps, tokens in zip(result["itls"], result["output_lens"], strict=True):
        if tokens > 1 and gaps:
            tpots.append(1000.0 * sum(gaps) / (tokens - 1))
    return tpots


def measurement(result: dict) -> dict:
    """What one run of one scenario on one server keeps from the load generator's result."""
    tpots = request_tpots_ms(result)
    chunks = sum(
        len(gaps) + 1 for gaps, n in zip(result["itls"], result["output_lens"], strict=True) if n
    )
    kept = (
        "completed",
        "failed",
        "duration",
        "output_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "median_tpot_ms",
    )
    return {
        **{key: result[key] for key in kept},
        "median_request_tpot_ms": statistics.median(tpots) if tpots else None,
        "tokens_per_chunk": result["total_output_tokens"] / chunks if chunks else None,
        "request_tpot_ms": tpots,
        "errors": sorted({e for e in result["errors"] if e})[:3],
    }


def summarize(records: list[dict], baseline: str) -> list[dict]:
    """One row per server and scenario: the medians over its good rounds (failed
    requests: their sum), and their ratios to the baseline's."""
    keys = list(dict.fromkeys((r["server"], r["scenario"]) for r in records))
    medians: dict[tuple[str, str], dict] = {}
    rows = []
    for key in keys:
        mine = [r for r in records if (r["server"], r["scenario"]) == key]
        good = [r["metrics"] for r in mine if r["status"] == "ok"]
        row = {"server": key[0], "scenario": key[1], "rounds": len(good)}
        if good:
            row["status"] = f"{len(good)}/{len(mine)}"
            for name, _, _ in COLUMNS:
                values = [m[name] for m in good if m.get(name) is not None]
                row[name] = statistics.median(values) if values else None
            row["failed"] = sum(m["failed"] for m in good)
            medians[key] = row
        else:
            row["status"] = mine[0]["status"]
        rows.append(row)
    for row in rows:
        base = medians.get((baseline, row["scenario"]))
        row["ratios"] = {
            name: row[name] / base[name]
            for name, _, ratio in COLUMNS
            if ratio and base and row.get(name) is not None and base.get(name)
        }
    return rows


def cell(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"


def table(rows: list[dict], baseline: str) -> str:
    header = ["server", "scenario", "rounds ok"]
    for _, title, ratio in COLUMNS:
        header += [title, f"× {baseline}"] if ratio else [title]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["server"], row["scenario"], row["status"]]
        for name, _, ratio in COLUMNS:
            cells.append(cell(row.get(name)))
            if ratio:
                found = row["ratios"].get(name)
                cells.append("-" if found is None else f"{found:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
