"""What tracing may be asked for: vLLM's detail modules and the OTLP protocols, checked."""

from __future__ import annotations

import os

# vLLM's --collect-detailed-traces modules that mean something here: the instances'
# detail (the handoff's children). `model` (per-request model time) is not collected.
DETAIL_MODULES = ("worker", "all")
PROTOCOLS = ("grpc", "http/protobuf")
PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def check_detail_modules(modules: tuple[str, ...]) -> None:
    """ValueError (one line) for a module that is not collected here."""
    for module in modules:
        if module not in DETAIL_MODULES:
            raise ValueError(
                f"--collect-detailed-traces {module}: choose from {', '.join(DETAIL_MODULES)} "
                "(instances do not time the model per request)"
            )


def otlp_protocol() -> str:
    """The protocol the OpenTelemetry variables name (grpc unless set), checked."""
    protocol = os.environ.get(
        PROTOCOL_VARIABLE, os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_VARIABLE}={protocol}: choose from {', '.join(PROTOCOLS)}")
    return protocol
