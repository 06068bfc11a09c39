"""The SLO trace against real servers on this machine: each fixed split of a small budget,
then the controller, one `pdserve serve` after another with identical flags, threads and
instances; the trace replayed at its timestamps by `pdserve bench serve`.

Each run's per-request outcomes (TTFT, chunk gaps, errors) are cut into the trace's
phases and scored against the trace's SLOs as the simulated runs are; the simulator's
replay of the controller on the same trace and calibration is its prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from experiments.serving import ADMIN_KEY, API_KEY, ServeProcess
from experiments.slo_trace import TraceRequest, phase_windows

Figures = dict
# Token ids that are ordinary words of the embedded model's vocabulary; random ones keep
# the prefix cache from serving one request from another's prompt.
LOW_ID, HIGH_ID = 1000, 40000


def write_trace(trace: list[TraceRequest], path: Path, seed: int) -> None:
    """The trace as `pdserve bench serve`'s JSONL dataset: token-id prompts, output
    lengths and timestamps."""
    rng = np.random.default_rng(seed)
    with path.open("w") as out:
        for request in trace:
            prompt = rng.integers(LOW_ID, HIGH_ID, request.prompt_tokens).tolist()
            record = {
                "prompt": prompt,
                "output_len": request.output_tokens,
                "timestamp": request.arrival,
            }
            out.write(json.dumps(record) + "\n")


def replay(url: str, dataset: Path, count: int, result: Path, timeout_s: float) -> dict:
    """One replay of the trace at its timestamps; the saved result with per-request lists."""
    command = [
        sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url,
        "--dataset-name", "jsonl", "--dataset-path", str(dataset), "--num-prompts", str(count),
        "--replay-timestamps", "--ignore-eos", "--save-detailed", "--disable-tqdm",
        "--result-filename", str(result),
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": API_KEY}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    if completed.returncode != 0:
        raise RuntimeError(f"bench serve failed:\n{completed.stderr[-2000:]}")
    return json.loads(result.read_text())


def tpot(itls: list[float], output_tokens: int) -> float:
    return sum(itls) / (output_tokens - 1) if output_tokens > 1 else 0.0


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def score(
    result: dict,
    trace: list[TraceRequest],
    scale: float,
    slos_ms: tuple[float, float],
    moves_at: list[float],
) -> list[Figures]:
    """Per phase and overall, the figures `slo_control` prints for a simulated run."""
    ttft_slo, itl_slo = slos_ms[0] / 1e3, slos_ms[1] / 1e3
    windows = phase_windows(scale)
    rows = []
    for name, start, end in [*windows, ("all", 0.0, windows[-1][2])]:
        picked = [i for i, r in enumerate(trace) if name in ("all", r.phase)]
        done = [i for i in picked if not result["errors"][i]]
        good = [
            i
            for i in done
            if result["ttfts"][i] <= ttft_slo
            and tpot(result["itls"][i], result["output_lens"][i]) <= itl_slo
        ]
        ttft = np.array([result["ttfts"][i] for i in done]) * 1e3
        gaps = np.array([g for i in done for g in result["itls"][i]]) * 1e3

        rows.append(
            {
                "phase": name,
                "requests": len(picked),
                "goodput": len(good) / max(end - start, 1e-9),
                "attainment": len(good) / len(picked) if picked else float("nan"),
                "ttft_p50": pct(ttft, 50),
                "ttft_p99": pct(ttft, 99),
                "itl_p50": pct(gaps, 50),
                "itl_p99": pct(gaps, 99),
                "failed": len(picked) - len(done),
                "decisions": sum(1 for at in moves_at if start <= at < end),
            }
        )
    return rows


class DecisionWatch:
    """Polls `GET /admin/controller` while a run lasts; keeps every decision once, with
    its time from the run's start."""

    def __init__(self, server: ServeProcess, started: float, poll_s: float = 10.0) -> None:
        self.server, self.started, self.poll_s = server, started, poll_s
        self.seen: dict[float, dict] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def poll(self) -> None:
        response = self.server.get(
            "/admin/controller", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        now = time.monotonic()
        for d in response.json().get("decisions", []):
            self.seen.setdefault(d["at"], {**d, "run_s": now - d["age_s"] - self.started})

    def run(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            self.poll()

    def finish(self) -> list[dict]:
        self.stop_event.set()
        self.thread.join()
        self.poll()
        return sorted(self.seen.values(), key=lambda d: d["at"])


def run_server(
    label: str,
    flags: list[str],
    trace: list[TraceRequest],
    dataset: Path,
    watch: bool,
    timeout_s: float,
) -> tuple[dict, list[dict]]:
    """Starts a server with `flags`, replays the trace, stops it: (result, decisions)."""
    print(f"{label}: pdserve serve {' '.join(flags)}", flush=True)
    server = ServeProcess.start(*flags)
    try:
        started = time.monotonic()
        watcher = DecisionWatch(server, started) if watch else None
        if watcher:
            watcher.thread.start()
        with tempfile.TemporaryDirectory(prefix="slo-real-") as folder:
            result = replay(
                server.base_url, dataset, len(trace), Path(folder) / "result.json", timeout_s
            )
        decisions = watcher.finish() if watcher else []
    finally:
        server.stop(timeout_s=60.0)
    return result, decisions


def real_runs(
    args: argparse.Namespace,
    trace: list[TraceRequest],
    flags: tuple[list[str], list[str]],
    show: Callable[[str, list[Figures]], None],
) -> tuple[list[tuple[str, list[Figures]]], tuple[list[Figures], list[dict]]]:
    """Every fixed split of the budget, then the controller from an even split; `flags`:
    every server's, then what the controller's run adds."""
    budget = args.instances
    common, controlling = flags
    slos = (args.ttft_slo_ms, args.itl_slo_ms)
    with tempfile.TemporaryDirectory(prefix="slo-trace-") as folder:
        dataset = Path(folder) / "trace.jsonl"
        write_trace(trace, dataset, args.seed)
        fixed = []
        for prefill in range(1, budget):
            label = f"{prefill}P+{budget - prefill}D"
            split = ["--num-prefill", str(prefill), "--num-decode", str(budget - prefill)]
            result, _ = run_server(
                label, [*common, *split], trace, dataset, False, args.run_timeout
            )
            rows = score(result, trace, args.scale, slos, [])
            show(f"fixed split {label}", rows)
            fixed.append((label, rows))
        half = budget // 2
        split = ["--num-prefill", str(half), "--num-decode", str(budget - half)]
        result, decisions = run_server(
            "controller", [*common, *split, *controlling], trace, dataset, True, args.run_timeout
        )
    moves = [d["run_s"] for d in decisions if d["action"] != "hold"]
    controlled = score(result, trace, args.scale, slos, moves)
    show(f"controller (from {half}P+{budget - half}D)", controlled)
    return fixed, (controlled, decisions)
