"""The side-by-side report of `experiments.pd_vs_colocated`: stall counts, table and ratios."""

from __future__ import annotations

import json

from experiments.pd_vs_colocated import main, ratios, stalls, table


def result(itls: list[list[float]], p99_ms: float) -> dict:
    return {
        "itls": itls,
        "p99_itl_ms": p99_ms,
        "median_itl_ms": 80.0,
        "median_ttft_ms": 2000.0,
        "p95_ttft_ms": 9000.0,
    }


def test_stalls_counts_gaps_over_the_threshold_across_requests() -> None:
    r = result([[0.08, 2.5, 0.09], [0.07], [1.2, 0.1]], 0.0)
    longest, count, total = stalls(r)
    assert longest == 2500.0
    assert (count, total) == (2, 6)
    assert stalls(r, threshold_s=2.0)[1] == 1
    assert stalls({"itls": []}) == (0.0, 0, 0)


def test_table_and_ratios_put_the_modes_side_by_side() -> None:
    rows = [
        {"mode": "disaggregated", "load": 0.5, "rate": 0.1, "result": result([[0.1, 0.2]], 50.0)},
        {"mode": "colocated", "load": 0.5, "rate": 0.1, "result": result([[0.1, 2.0]], 200.0)},
    ]
    text = table(rows)
    assert "| disaggregated | 50% | 0.1000 |" in text
    assert text.splitlines()[3].endswith("| 2000 | 1 of 2 |")
    (line,) = ratios(rows)
    assert line.startswith("load 50%: disaggregated / colocated: p99_itl_ms 0.25x")


def test_a_finished_run_is_reprinted_from_its_summary(tmp_path, capsys) -> None:
    rows = [{"mode": "colocated", "load": 0.8, "rate": 0.2, "result": result([[3.0]], 900.0)}]
    (tmp_path / "summary.json").write_text(json.dumps({"rows": rows}))
    assert main(["--show", str(tmp_path)]) == 0
    assert "| colocated | 80% | 0.2000 |" in capsys.readouterr().out
