"""`pdserve serve`'s observability and debugging flags, and their checks."""

from __future__ import annotations

import argparse

from pdserve.gateway.trace_config import DETAIL_MODULES, check_detail_modules, otlp_protocol


def add_observability_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export one OpenTelemetry trace per request to this OTLP collector (gRPC, or "
        "HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); docs/operations.md",
    )
    group.add_argument(
        "--collect-detailed-traces",
        default=None,
        metavar="MODULES",
        help=f"comma-separated, of {', '.join(DETAIL_MODULES)}: model has the instances "
        "time the model per step and puts each request's forward and execute seconds on "
        "its spans; worker adds the instances' detail spans (the handoff's wait for a "
        "decode seat and its KV transfer); all both. Needs --otlp-traces-endpoint; "
        "docs/operations.md",
    )


def add_debug_flags(debug: argparse._ArgumentGroup) -> None:
    debug.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error")
    )
    debug.add_argument(
        "--enable-test-hooks",
        action="store_true",
        help="tests only: the /debug/* routes, the instances' leak task and the "
        "PDSERVE_TEST_KV_DELAY_S pull delay (all absent without it)",
    )


def detail_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """`--collect-detailed-traces` as a tuple of modules (empty without the flag)."""
    if args.collect_detailed_traces is None:
        return ()
    return tuple(m.strip() for m in args.collect_detailed_traces.split(",") if m.strip())


def check_tracing_flags(args: argparse.Namespace) -> None:
    """ValueError (one line) for tracing flags that cannot be served."""
    endpoint = args.otlp_traces_endpoint
    if endpoint is not None and not endpoint.strip():
        raise ValueError("--otlp-traces-endpoint needs a URL")
    modules = detail_modules(args)
    if args.collect_detailed_traces is not None and not modules:
        raise ValueError(f"--collect-detailed-traces needs one of {', '.join(DETAIL_MODULES)}")
    check_detail_modules(modules)
    if modules and endpoint is None:
        raise ValueError("--collect-detailed-traces needs --otlp-traces-endpoint")
    if endpoint is not None:
        otlp_protocol()
