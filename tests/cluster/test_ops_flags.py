"""The tracing flags' checks: what `pdserve serve` refuses in one line before it starts."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cluster.ops_flags import check_tracing_flags, detail_modules


def flags(endpoint: str | None = None, detailed: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(otlp_traces_endpoint=endpoint, collect_detailed_traces=detailed)


def test_detailed_traces_take_vllms_comma_list() -> None:
    args = flags("http://127.0.0.1:4317", "worker, all")
    check_tracing_flags(args)
    assert detail_modules(args) == ("worker", "all")
    assert detail_modules(flags()) == ()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (flags("  "), "--otlp-traces-endpoint needs a URL"),
        (flags(None, "worker"), "needs --otlp-traces-endpoint"),
        (flags("http://x:4317", "model"), "instances do not time the model"),
        (flags("http://x:4317", ","), "needs one of worker, all"),
    ],
)
def test_tracing_flags_that_cannot_be_served_are_refused(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_tracing_flags(args)


def test_an_unknown_otlp_protocol_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json: choose from grpc, http/protobuf"):
        check_tracing_flags(flags("http://x:4318/v1/traces"))
