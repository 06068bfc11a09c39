"""The simulator against a measured `bench serve` run: same arrivals, same lengths.

`workload_of` rebuilds the run's workload from its result JSON (the arrival schedule
is a pure function of the rate, burstiness and seed `bench serve` used; the lengths are
the ones the server reported), `predict` simulates it on a deployment, and `compare`
puts the latency figures side by side with their ratios and a pass/fail against the
tolerances (medians within 25%, p95s within 40% by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.bench.arrivals import arrival_offsets
from pdserve.planner.sim.simulator import ClusterConfig, Workload, simulate, summarize_simulation

FIGURES = (
    ("median_ttft_ms", "TTFT p50"),
    ("p95_ttft_ms", "TTFT p95"),
    ("median_itl_ms", "ITL p50"),
    ("p95_itl_ms", "ITL p95"),
)


@dataclass(frozen=True)
class Tolerances:
    median: float = 0.25
    p95: float = 0.40

    def of(self, key: str) -> float:
        return self.median if key.startswith("median") else self.p95


def workload_of(result: dict, seed: int) -> Workload:
    """The arrivals and lengths of a finished `bench serve` run (no max concurrency)."""
    if result.get("max_concurrency"):
        raise ValueError("runs capped by --max-concurrency have no fixed arrival schedule")
    if result["failed"]:
        raise ValueError(f"the run had {result['failed']} failed requests")
    rate = result["request_rate"]
    rate = math.inf if rate == "inf" else float(rate)
    count = len(result["input_lens"])
    arrivals = arrival_offsets(count, rate, float(result.get("burstiness", 1.0)), seed)
    return Workload(
        [float(t) for t in arrivals],
        [int(n) for n in result["input_lens"]],
        [int(n) for n in result["output_lens"]],
    )


def predict(config: ClusterConfig, workload: Workload) -> dict:
    return summarize_simulation(simulate(config, workload), percentiles=(50.0, 95.0, 99.0))


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    measured: float
    predicted: float
    tolerance: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured if self.measured > 0 else math.inf

    @property
    def passed(self) -> bool:
        return abs(self.ratio - 1.0) <= self.tolerance

    def cell(self) -> str:
        verdict = "ok" if self.passed else "MISS"
        return f"{self.measured:.0f} / {self.predicted:.0f} ({self.ratio:.2f} {verdict})"


def compare(measured: dict, predicted: dict, tolerances: Tolerances = Tolerances()) -> list[Figure]:
    return [
        Figure(key, label, float(measured[key]), float(predicted[key]), tolerances.of(key))
        for key, label in FIGURES
    ]


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per (mode, load); each cell measured / predicted (ratio)."""
    header = ["mode", "load", "req/s", *(label + " ms" for _, label in FIGURES)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["mode"], f"{row['load']:.0%}", f"{row['rate']:.3f}"]
        cells += [figure.cell() for figure in row["figures"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tally(rows: list[dict]) -> str:
    figures = [f for row in rows for f in row["figures"]]
    passed = sum(f.passed for f in figures)
    misses = [
        f"{row['mode']} {row['load']:.0%} {f.label} ({f.ratio:.2f})"
        for row in rows
        for f in row["figures"]
        if not f.passed
    ]
    text = f"{passed}/{len(figures)} figures within tolerance"
    return text + (f"; misses: {', '.join(misses)}" if misses else "")
