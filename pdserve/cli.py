"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys

from pdserve import __version__
from pdserve.bench.cli import add_bench_parser
from pdserve.cluster.help_format import DefaultsHelpFormatter
from pdserve.cluster.serve_cli import add_serve_parser
from pdserve.eval.cli import add_eval_parser
from pdserve.planner.cli import add_calibrate_parser, add_plan_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    bench = add_bench_parser(sub)
    add_calibrate_parser(bench)
    add_plan_parser(sub)
    evaluate = add_eval_parser(sub)
    # Every command's --help shows its defaults, as serve's does.
    for command in (sub.choices["plan"], *bench.choices.values(), *evaluate.choices.values()):
        command.formatter_class = DefaultsHelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "handler"):
        return args.handler(args)
    print(f"pdserve: '{args.command}' is not available yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
