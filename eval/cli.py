"""`pdserve eval compare`: is the candidate's quality close enough to the baseline's?

Exit status: 0 normal, 1 look at the categories, 3 roll back; 2 a usage error (one line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from pdserve.bench.cli import guarded, positive_int
from pdserve.eval.dataset import SHIPPED_DATASET

EPILOG = (
    "The verdict: a drop of <= 1.5 percentage points is normal; 1.5-3 look at the "
    "categories; > 3 roll back to a less aggressive format (exit status 0, 1, 3)."
)


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def run_compare_command(args: argparse.Namespace) -> int:
    from pdserve.eval.compare import CompareConfig, Server, run_compare
    from pdserve.eval.items import load_items
    from pdserve.eval.report import format_report
    from pdserve.eval.verdict import EXIT_STATUS

    items = load_items(args.dataset)
    baseline = Server(
        args.baseline,
        args.baseline_model or args.model,
        args.baseline_api_key or args.api_key,
    )
    candidate = Server(
        args.candidate,
        args.candidate_model or args.model,
        args.candidate_api_key or args.api_key,
    )
    config = CompareConfig(
        seed=args.seed, max_concurrency=args.max_concurrency, timeout_s=args.request_timeout
    )
    result = asyncio.run(run_compare(items, baseline, candidate, config))
    result["dataset"] = str(args.dataset)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"saved {args.json}")
    return EXIT_STATUS[result["verdict"]]


def add_compare_parser(eval_sub) -> None:
    parser = eval_sub.add_parser(
        "compare",
        help="score a candidate server against a baseline on one set of prompts",
        epilog=EPILOG,
    )
    parser.add_argument("--baseline", required=True, metavar="URL", help="e.g. the BF16 server")
    parser.add_argument("--candidate", required=True, metavar="URL", help="e.g. the INT4 server")
    parser.add_argument(
        "--dataset",
        default=SHIPPED_DATASET,
        metavar="FILE.jsonl",
        help="items to score (default: the set made for SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--model", default=None, help="model name on both (default: each one's first /v1/models)"
    )
    parser.add_argument("--baseline-model", default=None, help="the baseline's, if it differs")
    parser.add_argument("--candidate-model", default=None, help="the candidate's, if it differs")
    parser.add_argument(
        "--api-key", default=None, help="bearer key for both (default: OPENAI_API_KEY)"
    )
    parser.add_argument("--baseline-api-key", default=None, help="the baseline's own key")
    parser.add_argument("--candidate-api-key", default=None, help="the candidate's own key")
    parser.add_argument("--seed", type=int, default=0, help="sent with every request")
    parser.add_argument(
        "--max-concurrency", type=positive_int, default=8, help="requests in flight per server"
    )
    parser.add_argument(
        "--request-timeout", type=positive_float, default=120.0, help="seconds per request"
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="write the full result")
    parser.set_defaults(handler=guarded("eval compare", run_compare_command))


def add_eval_parser(subparsers) -> argparse._SubParsersAction:
    """`pdserve eval ...`: quality checks of running servers."""
    parser = subparsers.add_parser("eval", help="check the quality of running servers")
    eval_sub = parser.add_subparsers(dest="eval_command", required=True)
    add_compare_parser(eval_sub)
    return eval_sub
