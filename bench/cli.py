"""Command-line front ends: `pdserve bench serve|sweep`.

Flags follow `vllm bench serve` where one exists. Every handler turns bad input into
a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from pdserve.bench.datasets import DATASET_NAMES, DatasetSpec
from pdserve.bench.metrics import METRIC_NAMES

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
T = TypeVar("T")


def guarded(
    name: str,
    handler: Callable[[argparse.Namespace], int],
    errors: tuple[type[Exception], ...] = (),
):
    """Run a handler; expected failures (and `errors`) become one line on stderr."""

    expected: tuple[type[Exception], ...] = (ValueError, OSError, *errors)

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except expected as exc:
            print(f"pdserve {name}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"pdserve {name}: interrupted", file=sys.stderr)
            return 130

    return run


def from_flags(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """The dataclass `cls` with `values`, and each other field that a flag of the same
    name exists for set from that flag (the rest keep their defaults)."""
    named = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name not in values and hasattr(args, f.name)
    }
    return cls(**named, **values)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a comma-separated list of integers"
        ) from None


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object: {text}")
    return value


def parse_metadata(pairs: list[str] | None) -> dict[str, str]:
    """`["site=lab", "run=3"]` -> {"site": "lab", "run": "3"}, as vLLM's `--metadata`."""
    metadata: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--metadata '{pair}' must look like KEY=VALUE")
        metadata[key.strip()] = value.strip()
    return metadata


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    from pdserve.bench.client import BACKENDS

    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI-compatible server")
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions (API key from "
        "OPENAI_API_KEY)",
    )
    group.add_argument("--endpoint", default=None, help="path (default: the backend's)")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as vLLM")
    group.add_argument(
        "--extra-body", type=json_object, default=None, help="JSON merged into every request"
    )
    group.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        help="wait up to this long for /v1/models to answer 200 (0: no wait)",
    )
    group.add_argument("--model", default=None, help="model name (default: the server's only one)")
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    group.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    group.add_argument("--seed", type=int, default=0)


def add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    group.add_argument("--dataset-path", default=None, help="ShareGPT or JSONL file")
    group.add_argument("--random-input-len", type=positive_int, default=1024)
    group.add_argument("--random-output-len", type=positive_int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0)
    group.add_argument("--sharegpt-output-len", type=positive_int, default=None)
    group.add_argument("--rag-num-documents", type=positive_int, default=8)
    group.add_argument("--rag-chunk-len", type=positive_int, default=256)
    # vLLM's prefix_repetition dataset: each prompt one of a few shared prefixes, then a
    # suffix of its own.
    for flag, default, meaning in (
        ("--prefix-repetition-prefix-len", 256, "tokens"),
        ("--prefix-repetition-suffix-len", 256, "tokens"),
        ("--prefix-repetition-num-prefixes", 10, "distinct prefixes"),
        ("--prefix-repetition-output-len", 128, "tokens"),
    ):
        group.add_argument(flag, type=positive_int, default=default, help=meaning)
    group.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer folder (with tokenizer.json) to count tokens with",
    )
    group.add_argument(
        "--token-counting",
        choices=("auto", "server", "approximate"),
        default="auto",
        help="without --tokenizer: the server's /tokenize (auto: if it answers) or words",
    )


def dataset_spec(args: argparse.Namespace, num_prompts: int) -> DatasetSpec:
    return from_flags(
        DatasetSpec,
        args,
        name=args.dataset_name,
        path=args.dataset_path,
        num_prompts=num_prompts,
        text_prompts=args.backend == "openai-chat",
    )


def pick_counting(args: argparse.Namespace):
    """The tokenizer that counts (and, when exact, makes) prompt tokens."""
    from pdserve.bench.tokenizer import (
        ApproximateTokenizer,
        LocalTokenizer,
        ServerTokenizer,
        pick_tokenizer,
    )

    if args.tokenizer:
        if args.token_counting != "auto":
            raise ValueError(f"--tokenizer and --token-counting {args.token_counting} conflict")
        return LocalTokenizer(args.tokenizer)
    if args.token_counting == "approximate":
        return ApproximateTokenizer()
    if args.token_counting == "server":
        return ServerTokenizer(args.base_url, args.model)
    return pick_tokenizer(args.base_url, args.model)


def build_dataset(args: argparse.Namespace, num_prompts: int):
    from pdserve.bench.client import wait_until_ready
    from pdserve.bench.datasets import build_samples

    # Before the dataset: counting tokens may already ask the server.
    if args.ready_check_timeout_sec > 0:
        wait_until_ready(args.base_url, args.ready_check_timeout_sec)
    return build_samples(dataset_spec(args, num_prompts), pick_counting(args))


def ignores_eos(args: argparse.Namespace) -> bool:
    # Synthetic prompts would stop at random EOS tokens: run them to their lengths,
    # as vLLM does for its random dataset.
    return args.ignore_eos or args.dataset_name in ("random", "rag", "prefix_repetition")


def run_serve(args: argparse.Namespace) -> int:
    from pdserve.bench.metrics import parse_goodput, parse_metric_names, parse_percentiles
    from pdserve.bench.runner import RunConfig, format_report, run_benchmark, save_result

    config = from_flags(
        RunConfig,
        args,
        ignore_eos=ignores_eos(args),
        timeout_s=args.request_timeout,
        percentiles=parse_percentiles(args.metric_percentiles),
        percentile_metrics=parse_metric_names(args.percentile_metrics),
        goodput_slos_ms=parse_goodput(args.goodput),
        show_progress=not args.disable_tqdm,
        tokenizer_id=args.tokenizer,
        metadata=parse_metadata(args.metadata),
    )
    samples = build_dataset(args, args.num_prompts)
    result = asyncio.run(run_benchmark(samples, config))
    print(format_report(result))
    if args.save_result or args.result_filename:
        path = save_result(result, args.result_filename, args.result_dir)
        print(f"saved {path}")
    return 0 if result["completed"] else 1


def add_load_parser(bench_sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand that sends a dataset's requests to a server: its flags for both."""
    parser = bench_sub.add_parser(name, help=help)
    add_server_flags(parser)
    add_dataset_flags(parser)
    return parser


def add_serve_parser(bench_sub) -> None:
    parser = add_load_parser(bench_sub, "serve", "load-test a running OpenAI-compatible server")
    parser.add_argument("--num-prompts", type=positive_int, default=1000)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s, or inf")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=positive_int, default=None)
    parser.add_argument("--num-warmups", type=int, default=0, help="requests left out")
    parser.add_argument(
        "--replay-timestamps",
        action="store_true",
        help="send jsonl requests at their recorded 'timestamp' offsets",
    )
    parser.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES))
    parser.add_argument("--metric-percentiles", default="50,95,99")
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000",
    )
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument(
        "--save-detailed",
        action="store_true",
        help="also save each request's generated text (generated_texts)",
    )
    parser.add_argument("--result-dir", default=None, help="folder of the result file")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--label", default=None, help="prefix of the default result filename")
    parser.add_argument(
        "--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="saved in the result"
    )
    parser.set_defaults(handler=guarded("bench serve", run_serve))


REDUCED_PROFILE = {"concurrency_steps": [1, 2, 4, 8], "requests_per_step": 20, "num_warmups": 5}


def run_sweep_command(args: argparse.Namespace) -> int:
    from pdserve.bench.metrics import parse_percentiles
    from pdserve.bench.sweep import SweepConfig, format_sweep, run_sweep
    from pdserve.bench.sweep_plot import plot_sweep

    config = from_flags(
        SweepConfig,
        args,
        percentiles=parse_percentiles(args.metric_percentiles),
        ignore_eos=ignores_eos(args),
        timeout_s=args.request_timeout,
        prefill_probe=not args.no_prefill_probe,
        show_progress=not args.disable_tqdm,
        **(REDUCED_PROFILE if args.reduced else {}),
    )
    config.validate()
    samples = build_dataset(args, config.requests_needed())
    result = asyncio.run(run_sweep(samples, config))
    stem = args.result_filename or f"sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    json_path = Path(stem)
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(format_sweep(result))
    print(f"saved {json_path}")
    if result["steps"]:
        png = plot_sweep(result, args.plot_filename or json_path.with_suffix(".png"))
        print(f"saved {png}")
    return 0 if result["working_point"] else 1


def add_sweep_parser(bench_sub) -> None:
    parser = add_load_parser(bench_sub, "sweep", "find the working point over concurrency steps")
    parser.add_argument("--concurrency-steps", type=int_list, default=[1, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--requests-per-step", type=positive_int, default=300)
    parser.add_argument("--num-warmups", type=int, default=100)
    parser.add_argument("--warmup-concurrency", type=positive_int, default=8)
    parser.add_argument(
        "--reduced",
        action="store_true",
        help="short profile: steps 1,2,4,8 of 20 requests, 5 warm-ups",
    )
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="p95 TTFT limit")
    parser.add_argument("--itl-slo-ms", type=float, default=50.0, help="p95 ITL limit")
    parser.add_argument(
        "--plateau-gain",
        type=float,
        default=0.10,
        help="stop when throughput gains less than this fraction",
    )
    parser.add_argument("--metric-percentiles", default="50,95,99")
    parser.add_argument(
        "--metrics-interval-s",
        type=float,
        default=0.5,
        help="seconds between scrapes of the server's /metrics (peak KV-cache usage)",
    )
    parser.add_argument("--num-gpus", type=positive_int, default=1, help="GPUs of the server")
    parser.add_argument("--num-prefill-gpus", type=positive_int, default=None)
    parser.add_argument("--num-decode-gpus", type=positive_int, default=None)
    parser.add_argument(
        "--no-prefill-probe",
        action="store_true",
        help="skip the one-token probe that splits GPU time by phase",
    )
    parser.add_argument("--result-filename", default=None, help="JSON path")
    parser.add_argument("--plot-filename", default=None, help="PNG path (default: beside JSON)")
    parser.set_defaults(handler=guarded("bench sweep", run_sweep_command))


def add_bench_parser(subparsers) -> argparse._SubParsersAction:
    """`pdserve bench ...`: load generation and sweeps; returns the subcommands, where
    the planner adds `calibrate`."""
    bench = subparsers.add_parser("bench", help="benchmark a server or the engine")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_serve_parser(bench_sub)
    add_sweep_parser(bench_sub)
    return bench_sub
