"""What tracing may be asked for: vLLM's detail modules and the OTLP protocols, checked."""

from __future__ import annotations

import os

# vLLM's --collect-detailed-traces modules: `model` has the instances time the model per
# step and charge each request its steps (attributes on its compute spans and the root),
# `worker` adds the instances' detail spans (the handoff's children), `all` both.
DETAIL_MODULES = ("model", "worker", "all")
PROTOCOLS = ("grpc", "http/protobuf")
PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def check_detail_modules(modules: tuple[str, ...]) -> None:
    """ValueError (one line) for a module that is not collected here."""
    for module in modules:
        if module not in DETAIL_MODULES:
            raise ValueError(
                f"--collect-detailed-traces {module}: choose from {', '.join(DETAIL_MODULES)}"
            )


def collects_model(modules: tuple[str, ...]) -> bool:
    """Whether the instances time the model per request (`model` or `all`)."""
    return "model" in modules or "all" in modules


def collects_worker(modules: tuple[str, ...]) -> bool:
    """Whether traces get the instances' detail spans (`worker` or `all`)."""
    return "worker" in modules or "all" in modules


def otlp_protocol() -> str:
    """The protocol the OpenTelemetry variables name (grpc unless set), checked."""
    protocol = os.environ.get(
        PROTOCOL_VARIABLE, os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_VARIABLE}={protocol}: choose from {', '.join(PROTOCOLS)}")
    return protocol
