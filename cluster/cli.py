"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys

from bench.cli import add_bench_parser, add_plan_parser
from cluster.serve_cli import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "handler"):
        return args.handler(args)
    print(f"pdserve: '{args.command}' is not available yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
