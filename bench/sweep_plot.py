"""The sweep's PNG: latency percentiles and throughput against concurrency."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display

import matplotlib.pyplot as plt  # noqa: E402


def plot_sweep(result: dict, path: str | Path) -> Path:
    """Draw the sweep; the stop step is marked red and the working point shaded."""
    steps = result["steps"]
    if not steps:
        raise ValueError("the sweep has no steps to plot")
    concurrency = [s["concurrency"] for s in steps]
    fig, (latency_ax, throughput_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label, style in (
        ("p50_ttft_ms", "p50 TTFT", "o-"),
        ("p95_ttft_ms", "p95 TTFT", "o--"),
        ("p50_itl_ms", "p50 ITL", "s-"),
        ("p95_itl_ms", "p95 ITL", "s--"),
    ):
        latency_ax.plot(concurrency, [s[key] for s in steps], style, label=label)
    config = result["config"]
    latency_ax.axhline(config["ttft_slo_ms"], color="tab:blue", lw=0.8, ls=":", label="TTFT SLO")
    latency_ax.axhline(config["itl_slo_ms"], color="tab:green", lw=0.8, ls=":", label="ITL SLO")
    latency_ax.set_yscale("log")
    latency_ax.set_ylabel("latency (ms)")
    latency_ax.set_title("Latency percentiles")
    throughput_ax.plot(concurrency, [s["output_throughput"] for s in steps], "o-", label="output")
    throughput_ax.plot(
        concurrency, [s["total_token_throughput"] for s in steps], "o--", label="total"
    )
    throughput_ax.set_ylabel("tokens/s")
    throughput_ax.set_title("Throughput")
    for ax in (latency_ax, throughput_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        mark_limits(ax, result)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"bench sweep: {result.get('model_id') or 'server'}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def mark_limits(ax, result: dict) -> None:
    stop = result.get("stopped_at")
    if stop:
        ax.axvline(stop["concurrency"], color="red", lw=1.5, label=f"stop @ {stop['concurrency']}")
    point = result.get("working_point")
    if point:
        low, high = point["concurrency_low"], point["concurrency_high"]
        ax.axvspan(low * 0.97, high * 1.03, color="tab:green", alpha=0.2, label="working point")
