"""pdserve beside the engines its users would pick instead, on this machine, in one run.

    python -m experiments.side_by_side --scenarios single --repeats 3 \\
        --servers colocated-bf16 vllm-bf16 llama-f16 --out side-by-side.json

Servers (`experiments/engines.py`): pdserve configurations (`--pdserve LABEL=FLAGS`;
by default colocated on one instance and one prefill + one decode instance, both
bfloat16), vLLM for CPU (`--vllm LABEL=FLAGS`) and llama-server (`--llama LABEL=MODEL
FLAGS`), the peers from their install folders (`../shared/peers/README.md`). A peer
that is not installed gets a "skipped: not installed" row naming the command that
installs it; a server that does not start gets a "failed" row; the others still run.
Every server serves the same checkpoint (the embedded model's by default), unless a
pdserve label names its own model (`--pdserve 'q41=FILE.gguf --mode colocated'`: the same
weights packed; the prompts stay the checkpoint tokenizer's ids).

Scenarios: `single` (8 prompts, one at a time, 256 tokens in, 128 out), `c32` (32
prompts at 32 concurrent, 256 -> 128) and `rag` (16 prompts at 8 concurrent, 2000 ->
128, document chunks repeating across prompts). Every request is greedy, streamed and
runs to its length (ignore_eos), sent by pdserve's own load generator
(`pdserve.bench.runner`, in this process); every server gets the same prompts, as
token ids of the checkpoint's tokenizer.

Fairness: one server runs at a time (two would share the cores), and the run is
round-major: each round starts every server in turn, warms it up, runs every scenario
on it and stops it, and `--repeats` rounds follow one another (A, B, C, A, B, C...).
A neighbour's load that drifts over the run then falls on every server alike instead
of on whichever ran last, and every round starts from a cold prefix cache. Each
figure is the median over the rounds of the run's own figure; ratios are over the
`--baseline` server (the first one by default) in the same scenario.

TPOT is per request, from the client's clock: (last token's arrival - first token's)
/ (tokens - 1), its median over requests. Beside it, ITL is the median gap between
streamed chunks, which equals TPOT only when every chunk carries one token
(tok/chunk says how many do).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from experiments.engines import (
    PEER_SCRIPTS,
    NotInstalled,
    Peers,
    ServerSpec,
    StartFailed,
    check_installed,
    start_server,
)
from experiments.server_runs import add_server_flags, local_serve_args
from experiments.side_by_side_report import measurement, summarize, table
from pdserve.bench.datasets import DatasetSpec, SampleRequest, build_samples
from pdserve.bench.runner import RunConfig, run_benchmark
from pdserve.bench.tokenizer import ApproximateTokenizer, LocalTokenizer, Tokenizer


@dataclass(frozen=True)
class Scenario:
    name: str
    dataset: str
    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("single", "random", 8, 1, 256, 128),
        Scenario("c32", "random", 32, 32, 256, 128),
        Scenario("rag", "rag", 16, 8, 2000, 128),
    )
}
DEFAULT_SERVERS = {
    "pdserve": [
        "colocated-bf16=--mode colocated --num-colocated 1",
        "pd-bf16=--num-prefill 1 --num-decode 1",
    ],
    "vllm": ["vllm-bf16=--dtype bfloat16"],
    "llama": ["llama-f16=f16"],
}


def chosen_scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The scenarios asked for, with `--num-prompts` in place of their own counts."""
    chosen = [SCENARIOS[name] for name in args.scenarios]
    if args.num_prompts:
        return [replace(s, num_prompts=args.num_prompts) for s in chosen]
    return chosen


class SideBySide:
    """The rounds of one run: each server started, warmed up, measured, stopped."""

    def __init__(self, args: argparse.Namespace, peers: Peers, tokenizer: Tokenizer) -> None:
        self.args = args
        self.peers = peers
        self.scenarios = chosen_scenarios(args)
        self.samples = {
            s.name: self.make_samples(s, tokenizer, args.seed + 100 * i)
            for i, s in enumerate(self.scenarios)
        }
        # Prompts of their own: a warm-up never leaves a measured prompt in a cache.
        warm = Scenario("warm-up", "random", args.warmups, max(args.warmups, 1), 32, 16)
        self.warmup = self.make_samples(warm, tokenizer, args.seed + 99) if args.warmups else []
        self.pdserve_args = [
            *local_serve_args(args),
            "--kv-transport",
            args.kv_transport,
        ]

    @staticmethod
    def make_samples(scenario: Scenario, tokenizer: Tokenizer, seed: int) -> list[SampleRequest]:
        spec = DatasetSpec(
            name=scenario.dataset,
            num_prompts=scenario.num_prompts,
            seed=seed,
            random_input_len=scenario.input_len,
            random_output_len=scenario.output_len,
        )
        return build_samples(spec, tokenizer)

    def run(self, specs: list[ServerSpec]) -> list[dict]:
        """Every round's records, in the order they ran, then those of the servers
        skipped as not installed."""
        records: list[dict] = []
        skipped: list[dict] = []
        ready = []
        for spec in specs:
            try:
                check_installed(spec, self.peers)
                ready.append(spec)
            except NotInstalled as exc:
                print(f"{spec.label}: skipped: {exc}", flush=True)
                skipped += self.records_of(spec, None, f"skipped: {exc}")
        for repeat in range(self.args.repeats):
            for spec in ready:
                records += self.run_server(spec, repeat)
        return records + skipped

    def records_of(self, spec: ServerSpec, repeat: int | None, status: str) -> list[dict]:
        return [
            {
                "server": spec.label,
                "kind": spec.kind,
                "scenario": s.name,
                "repeat": repeat,
                "status": status,
            }
            for s in self.scenarios
        ]

    def run_server(self, spec: ServerSpec, repeat: int) -> list[dict]:
        """One round of `spec`: started, warmed up, every scenario, stopped by its PID."""
        print(f"round {repeat + 1}/{self.args.repeats}: starting {spec.label}", flush=True)
        started = time.monotonic()
        try:
            server = start_server(spec, self.peers, self.pdserve_args, self.args.start_timeout)
        except (StartFailed, NotInstalled) as exc:
            print(f"{spec.label}: did not start: {exc}", flush=True)
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return self.records_of(spec, repeat, f"failed: did not start ({first_line})")
        start_s = time.monotonic() - started
        records = []
        try:
            if self.warmup:
                self.measure(server.base_url, self.warmup, len(self.warmup))
            for scenario in self.scenarios:
                record = {
                    "server": spec.label,
                    "kind": spec.kind,
                    "scenario": scenario.name,
                    "repeat": repeat,
                    "pid": server.process.pid,
                    "start_s": start_s,
                }
                records.append({**record, **self.measure_scenario(spec, scenario, server.base_url)})
        finally:
            server.stop()
        return records

    def measure_scenario(self, spec: ServerSpec, scenario: Scenario, url: str) -> dict:
        try:
            result = self.measure(url, self.samples[scenario.name], scenario.concurrency)
        except TimeoutError:
            return {"status": f"failed: over {self.args.run_timeout:g} s"}
        found = measurement(result)
        status = "ok" if found["completed"] else f"failed: {'; '.join(found['errors'])}"
        tpot = found["median_request_tpot_ms"] or 0.0
        print(
            f"{spec.label} {scenario.name}: {found['output_throughput']:.1f} tok/s, "
            f"TTFT p50 {found['median_ttft_ms']:.0f} ms, TPOT p50 {tpot:.1f} ms, "
            f"{found['failed']} failed",
            flush=True,
        )
        return {"status": status, "metrics": found}

    def measure(self, url: str, samples: list[SampleRequest], concurrency: int) -> dict:
        config = RunConfig(
            base_url=url,
            max_concurrency=concurrency,
            ignore_eos=True,
            temperature=0.0,
            timeout_s=self.args.request_timeout,
            show_progress=False,
        )
        return asyncio.run(asyncio.wait_for(run_benchmark(samples, config), self.args.run_timeout))


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "load_average": os.getloadavg(),
    }


def server_specs(args: argparse.Namespace) -> list[ServerSpec]:
    """The servers the flags define, those `--servers` names (in its order) if given."""
    specs = [
        ServerSpec.parse(kind, text)
        for kind in DEFAULT_SERVERS
        for text in (getattr(args, kind) or DEFAULT_SERVERS[kind])
    ]
    by_label = {spec.label: spec for spec in specs}
    if len(by_label) < len(specs):
        raise ValueError("two servers share a label")
    if not args.servers:
        return specs
    unknown = [label for label in args.servers if label not in by_label]
    if unknown:
        raise ValueError(
            f"no server labelled {', '.join(unknown)}: choose from {', '.join(by_label)}"
        )
    return [by_label[label] for label in args.servers]


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(
        prog="python -m experiments.side_by_side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    found.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    found.add_argument("--repeats", type=int, default=3, help="rounds over every server")
    found.add_argument("--num-prompts", type=int, default=None, help="per scenario (its own)")
    for kind, what in (
        ("pdserve", "LABEL=FLAGS of pdserve serve"),
        ("vllm", "LABEL=FLAGS of vLLM's OpenAI server"),
        ("llama", "LABEL=MODEL FLAGS (MODEL: f16, q4_1 or a GGUF path)"),
    ):
        found.add_argument(
            f"--{kind}",
            action="append",
            metavar="SPEC",
            help=f"{what}; again for more (default: {DEFAULT_SERVERS[kind]})",
        )
    found.add_argument("--servers", nargs="+", metavar="LABEL", help="run only these, in order")
    found.add_argument("--baseline", default=None, help="label of the ratios' baseline (first)")
    found.add_argument("--checkpoint", default=None, help="default: the embedded model's folder")
    found.add_argument("--peer-scripts", default=str(PEER_SCRIPTS))
    found.add_argument("--vllm-dir", default="/tmp/peers/vllm", help="vllm-cpu.sh install DIR")
    found.add_argument(
        "--llama-dir", default="/tmp/peers/llama", help="llama-server.sh install DIR"
    )
    found.add_argument(
        "--approximate-tokens",
        action="store_true",
        help="word prompts instead of the checkpoint tokenizer's ids",
    )
    found.add_argument("--warmups", type=int, default=2, help="requests after each start")
    found.add_argument("--start-timeout", type=float, default=300.0, help="seconds per start")
    found.add_argument("--request-timeout", type=float, default=600.0)
    found.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per scenario")
    found.add_argument("--seed", type=int, default=0)
    found.add_argument("--out", default=None, help="JSON file (default: a new one in /tmp)")
    found.add_argument("--show", metavar="JSON", help="print the table of a finished run")
    add_server_flags(found, kv_cache_memory="2GiB", max_model_len=4096, max_num_batched_tokens=2048)
    # 0: pdserve's own share of the cores per instance, as the peers use all of them.
    found.set_defaults(threads_per_instance=0)
    return found


def stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends the run as Ctrl-C does: the server of the round is stopped first."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        return run(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    if args.show:
        try:
            saved = json.loads(Path(args.show).read_text())
            print(table(saved["rows"], saved["baseline"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"side_by_side: --show {args.show}: not a results file ({exc})", file=sys.stderr)
            return 2
        return 0
    specs = server_specs(args)
    baseline = args.baseline or specs[0].label
    if args.checkpoint is None:
        from pdserve.engine.embedded import embedded_model_path

        args.checkpoint = str(embedded_model_path())
    checkpoint = Path(args.checkpoint)
    peers = Peers(Path(args.peer_scripts), Path(args.vllm_dir), Path(args.llama_dir), checkpoint)
    tokenizer = (
        ApproximateTokenizer() if args.approximate_tokens else LocalTokenizer(str(checkpoint))
    )
    started = datetime.now(UTC)
    records = SideBySide(args, peers, tokenizer).run(specs)
    rows = summarize(records, baseline)
    text = table(rows, baseline)
    shown = argv if argv is not None else sys.argv[1:]
    out = Path(args.out or tempfile.mkstemp(prefix="side-by-side-", suffix=".json")[1])
    saved = {
        "command": "python -m experiments.side_by_side " + shlex.join(shown),
        "started": started.isoformat(timespec="seconds"),
        "wall_s": (datetime.now(UTC) - started).total_seconds(),
        "machine": machine(),
        "checkpoint": str(checkpoint),
        "baseline": baseline,
        "repeats": args.repeats,
        "scenarios": [asdict(s) for s in chosen_scenarios(args)],
        "servers": [asdict(spec) for spec in specs],
        "records": records,
        "rows": rows,
        "table": text,
    }
    out.write_text(json.dumps(saved, indent=2) + "\n")
    print(text)
    print(f"medians over {args.repeats} rounds; ratios over {baseline}; results in {out}")
    return 0 if any(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
