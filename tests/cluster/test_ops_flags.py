"""The tracing flags' checks: what `pdserve serve` refuses in one line before it starts,
and where model detail goes."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import build_parser
from pdserve.cluster.deployment import Deployment, ServeError
from pdserve.cluster.ops_flags import check_tracing_flags, detail_modules
from pdserve.gateway.trace_config import collects_model, collects_worker


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def flags(endpoint: str | None = None, detailed: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(otlp_traces_endpoint=endpoint, collect_detailed_traces=detailed)


def test_detailed_traces_take_vllms_comma_list() -> None:
    args = flags("http://127.0.0.1:4317", "worker, all")
    check_tracing_flags(args)
    assert detail_modules(args) == ("worker", "all")
    assert detail_modules(flags()) == ()


@pytest.mark.parametrize(
    ("detailed", "model", "worker"),
    [("model", True, False), ("worker", False, True), ("all", True, True),
     ("model,worker", True, True), (None, False, False)],
)  # fmt: skip
def test_model_and_worker_detail_follow_the_modules(detailed, model, worker) -> None:
    args = flags("http://127.0.0.1:4317", detailed)
    check_tracing_flags(args)
    assert collects_model(detail_modules(args)) is model
    assert collects_worker(detail_modules(args)) is worker


def test_model_detail_reaches_the_instances_engine_config() -> None:
    on = parse(
        "--otlp-traces-endpoint", "http://127.0.0.1:4317", "--collect-detailed-traces", "all"
    )
    assert Deployment.from_args(on, cores=[0, 1]).engine.collect_model_time is True
    worker = parse(
        "--otlp-traces-endpoint", "http://127.0.0.1:4317", "--collect-detailed-traces", "worker"
    )
    assert Deployment.from_args(worker, cores=[0, 1]).engine.collect_model_time is False
    assert Deployment.from_args(parse(), cores=[0, 1]).engine.collect_model_time is False


def test_junk_modules_stop_serve_with_one_line() -> None:
    junk = parse(
        "--otlp-traces-endpoint", "http://127.0.0.1:4317", "--collect-detailed-traces", "gpu"
    )
    with pytest.raises(ServeError) as error:
        Deployment.from_args(junk, cores=[0, 1])
    assert str(error.value) == "--collect-detailed-traces gpu: choose from model, worker, all"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (flags("  "), "--otlp-traces-endpoint needs a URL"),
        (flags(None, "worker"), "needs --otlp-traces-endpoint"),
        (flags("http://x:4317", "model,junk"), "junk: choose from model, worker, all$"),
        (flags("http://x:4317", ","), "needs one of model, worker, all"),
    ],
)
def test_tracing_flags_that_cannot_be_served_are_refused(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_tracing_flags(args)


def test_an_unknown_otlp_protocol_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json: choose from grpc, http/protobuf"):
        check_tracing_flags(flags("http://x:4318/v1/traces"))
