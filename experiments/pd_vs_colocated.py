"""Disaggregated (prefill + decode instances) against colocated serving, side by side.

    python -m experiments.pd_vs_colocated --num-prompts 24 --max-num-batched-tokens 256

One run does, on this machine, with `pdserve serve --launcher local`:
1. disaggregated (1 prefill + 1 decode by default): measure the saturation rate (as
   many prompts as a load sends, all at once, from a corpus of their own; completed
   requests per second), then Poisson arrivals at each fraction of it in `--loads`;
2. colocated (as many instances as the disaggregated run had, the same threads each):
   the same arrival rates, the same prompts (same seed);
and prints TTFT p50/p95, ITL p50/p99, throughput and goodput per mode and load, side
by side. Every measurement is `pdserve bench serve` (bench/cli.py) against the server,
with its RAG dataset (bench/rag.py: long prompts whose document chunks repeat); the
JSON of each run and a summary land in `--out-dir`.

The two modes run one after the other (never at once: they would share the cores), so
on a shared machine their figures drift apart with the load of the neighbours: compare
ratios from one run, and repeat the run to see the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from experiments.server_runs import add_server_flags, local_serve_args, run_bench_serve

SERVING = "pdserve: serving "
START_TIMEOUT_S = 600.0
# A gap this long is a stall: several times any decode step of these runs.
STALL_S = 1.0
COLUMNS = (
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p95_ttft_ms", "TTFT p95 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("request_goodput", "goodput req/s"),
)


class Server:
    """`pdserve serve` as a child process on a free port; stopped with SIGTERM."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        command = [sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", *args]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                text=True, env=env,
            )  # fmt: skip
        self.url = self._wait_for_url()

    def _wait_for_url(self) -> str:
        found: list[str] = []
        done = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith(SERVING) and not found:
                    found.append(line.rsplit(" on ", 1)[1].strip())
                    done.set()
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(START_TIMEOUT_S) or not found:
            self.stop()
            tail = self.log_path.read_text()[-2000:]
            raise RuntimeError(f"pdserve serve did not come up:\n{tail}")
        return found[0]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bench_serve(url: str, args: argparse.Namespace, out: Path, rate: str, num_prompts: int,
                seed: int) -> dict:  # fmt: skip
    """One `pdserve bench serve` run; its saved JSON."""
    result, printed = run_bench_serve(
        url, args, out, rate, num_prompts, seed,
        "--dataset-name", "rag", "--rag-num-documents", str(args.rag_documents), "--ignore-eos",
        "--num-warmups", str(args.warmups), "--goodput", *args.goodput,
        "--request-timeout", "3600", "--save-result",
    )  # fmt: skip
    print(printed, flush=True)
    return result


def run_loads(server: Server, args: argparse.Namespace, out: Path, mode: str,
              saturation: float) -> list[dict]:  # fmt: skip
    rows = []
    for index, load in enumerate(args.loads):
        rate = load * saturation
        result = bench_serve(server.url, args, out / f"{mode}-{load}.json", f"{rate:.6f}",
                             args.num_prompts, seed_of(args, index))  # fmt: skip
        rows.append({"mode": mode, "load": load, "rate": rate, "result": result})
    return rows


def seed_of(args: argparse.Namespace, load_index: int) -> int:
    """Each load gets prompts (and documents) of its own, the same in both modes: a run
    never starts with its documents already in the prefix cache of an earlier one."""
    return args.seed + 100 * (load_index + 1)


def serve_args(args: argparse.Namespace, mode: str) -> list[str]:
    common = [*local_serve_args(args), "--kv-transport", args.kv_transport]
    if mode == "disaggregated":
        return [*common, "--num-prefill", str(args.num_prefill), "--num-decode",
                str(args.num_decode)]  # fmt: skip
    return [*common, "--mode", "colocated", "--num-colocated",
            str(args.num_prefill + args.num_decode)]  # fmt: skip


def stalls(result: dict, threshold_s: float = STALL_S) -> tuple[float, int, int]:
    """The longest gap between streamed chunks (ms), how many gaps exceed the threshold,
    and how many gaps there are: a decode that waited for a prefill chunk shows here
    before p99 moves (p99 sees stalls only once they are over 1 % of the gaps)."""
    gaps = [gap for request in result.get("itls", []) for gap in request]
    longest = max(gaps) * 1000 if gaps else 0.0
    return longest, sum(gap > threshold_s for gap in gaps), len(gaps)


def table(rows: list[dict]) -> str:
    header = ["mode", "load", "rate req/s", *(title for _, title in COLUMNS), "ITL max ms",
              f"gaps > {STALL_S:g} s"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        r = row["result"]
        cells = [row["mode"], f"{row['load']:.0%}", f"{row['rate']:.4f}"]
        for key, _ in COLUMNS:
            value = r.get(key)
            cells.append("-" if value is None else f"{value:.3f}" if value < 10 else f"{value:.0f}")
        longest, count, total = stalls(r)
        cells += [f"{longest:.0f}", f"{count} of {total}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    """Disaggregated over colocated, per load, for the headline figures."""
    lines = []
    by = {(r["mode"], r["load"]): r["result"] for r in rows}
    for load in sorted({r["load"] for r in rows}):
        pd, co = by.get(("disaggregated", load)), by.get(("colocated", load))
        if not pd or not co:
            continue
        parts = []
        for key in ("p99_itl_ms", "median_itl_ms", "median_ttft_ms", "p95_ttft_ms"):
            if pd.get(key) and co.get(key):
                parts.append(f"{key} {pd[key] / co[key]:.2f}x")
        lines.append(f"load {load:.0%}: disaggregated / colocated: " + ", ".join(parts))
    return lines


def show(out: Path) -> None:
    """Prints the table of a finished run from its summary.json."""
    summary = json.loads((out / "summary.json").read_text())
    print(table(summary["rows"]))
    print("\n".join(ratios(summary["rows"])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.pd_vs_colocated",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--num-prompts", type=int, default=24, help="per load and mode")
    # The saturation burst sends as many prompts as a load run by default: RAG documents
    # repeat, so a short burst sees mostly cold prefixes and underestimates the rate
    # the loads actually run at.
    parser.add_argument("--saturation-prompts", type=int, default=None,
                        help="default: --num-prompts")  # fmt: skip
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8])
    parser.add_argument("--input-len", type=int, default=2250)
    parser.add_argument("--range-ratio", type=float, default=1 / 3)  # 1500..3000
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rag-documents", type=int, default=8)
    parser.add_argument("--warmups", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", default=["ttft:20000", "tpot:300"],
                        help="SLOs, as for pdserve bench serve")  # fmt: skip
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    # 2048 batched tokens: pdserve serve's default.
    add_server_flags(
        parser, kv_cache_memory="1GiB", max_model_len=3300, max_num_batched_tokens=2048
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="default: a new temporary folder")
    parser.add_argument("--show", metavar="DIR", help="print the table of a finished run")
    args = parser.parse_args(argv)
    if args.show:
        show(Path(args.show))
        return 0
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="pd-vs-colocated-"))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.time()
    with Server(serve_args(args, "disaggregated"), out / "server-disaggregated.log") as server:
        burst = args.saturation_prompts or args.num_prompts
        saturation = bench_serve(server.url, args, out / "saturation.json", "inf", burst,
                                 args.seed + 1)  # fmt: skip
        rate = saturation["request_throughput"]
        print(f"saturation of the disaggregated server: {rate:.4f} req/s", flush=True)
        rows += run_loads(server, args, out, "disaggregated", rate)
    with Server(serve_args(args, "colocated"), out / "server-colocated.log") as server:
        rows += run_loads(server, args, out, "colocated", rate)
    summary = {
        "command": " ".join(["python -m experiments.pd_vs_colocated", *(argv or sys.argv[1:])]),
        "saturation_req_s": rate,
        "wall_s": time.time() - started,
        "rows": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(rows))
    print("\n".join(ratios(rows)))
    print(f"saturation (disaggregated): {rate:.4f} req/s; goodput SLOs {' '.join(args.goodput)}; "
          f"results in {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
