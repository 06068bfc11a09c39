"""What tracing costs: single-stream inter-token latency of `pdserve serve` (1 prefill + 1
decode, embedded model, local launcher) without and with `--otlp-traces-endpoint` (to an
OTLP/HTTP receiver in this process), and of a baseline checkout (`--baseline`, served
from its tree through PYTHONPATH), interleaved in one run (base, off, on, base, ...).

    PYTHONPATH=. python -m experiments.tracing_overhead --rounds 2 --baseline /path/to/main
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from experiments.otlp_receiver import OTLPReceiver
from experiments.serving import API_KEY, LOCAL, served

KEYS = ("median_itl_ms", "mean_itl_ms", "median_ttft_ms")


def bench(base_url: str, args: argparse.Namespace, seed: int, result: str) -> dict:
    command = [
        sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", base_url,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", "1", "--num-warmups", "1",
        "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-filename", result,
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": API_KEY}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(result) as found:
        return json.load(found)


def run(args: argparse.Namespace) -> dict[str, list[dict]]:
    modes = ("base", "off", "on") if args.baseline else ("off", "on")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with OTLPReceiver() as receiver, tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for mode in modes:
                env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
                if mode == "base":
                    env["PYTHONPATH"] = args.baseline
                flags = ("--otlp-traces-endpoint", receiver.url) if mode == "on" else ()
                with served(*LOCAL, *flags, env=env) as server:
                    path = os.path.join(folder, f"{mode}-{round_}.json")
                    results[mode].append(bench(server.base_url, args, round_, path))
        print(f"spans received: {len(receiver.spans)}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--baseline", default=None, help="a checkout to serve as a third mode")
    args = parser.parse_args()
    results = run(args)
    print(f"{'':<6}" + "".join(f"{k:>16}" for k in KEYS))
    for mode, runs in results.items():
        cells = "".join(f"{statistics.median(r[k] for r in runs):>16.2f}" for k in KEYS)
        print(f"{mode:<6}{cells}")
        for r in runs:
            print(f"  {mode} run: " + " ".join(f"{k}={r[k]:.2f}" for k in KEYS))


if __name__ == "__main__":
    main()
