"""Each finished run as one OpenTelemetry trace, exported over OTLP by the SDK.

The spans are made from the run's timeline (`gateway/timelines.py`) once it ends, with
the start and end times its phases have, so nothing is traced on the per-token path and
the instances carry no OpenTelemetry. The root span (kind SERVER, named as the GenAI
semantic conventions say: `{gen_ai.operation.name} {gen_ai.request.model}`) is the
child of the client's `traceparent` when it sent one; each phase of each choice is its
child; with `--collect-detailed-traces worker` (or `all`) the handoff's own children (the
wait for a decode seat, the KV transfer) follow, and with `model` (or `all`) the compute
spans and the root carry the instances' model seconds (the root: its choice's sums, the
largest over choices when there are several). The SDK's batch processor exports from
its own thread. `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (`grpc`, the default, or
`http/protobuf`) picks the exporter, as vLLM's does; the SDK's other `OTEL_*` variables
apply.
"""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from pdserve.gateway.timeline import EXECUTE, FORWARD, Phase
from pdserve.gateway.timelines import ChoiceTimeline, RunFacts, RunTimeline
from pdserve.gateway.trace_config import check_detail_modules, collects_worker, otlp_protocol


def span_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter the protocol variable names, to `endpoint`."""
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=endpoint)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class TraceExporter:
    """Turns finished runs into spans and hands them to a span exporter."""

    def __init__(self, exporter: SpanExporter, detailed: bool = False) -> None:
        self._provider = TracerProvider(resource=Resource.create({"service.name": "pdserve"}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pdserve.gateway")
        self.detailed = detailed
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def to_endpoint(cls, endpoint: str, modules: tuple[str, ...] = ()) -> TraceExporter:
        check_detail_modules(modules)
        return cls(span_exporter(endpoint), detailed=collects_worker(modules))

    def export(self, run: RunTimeline, facts: RunFacts) -> None:
        carrier = {"traceparent": facts.trace.traceparent, "tracestate": facts.trace.tracestate}
        parent = self._propagator.extract(carrier) if facts.trace.traceparent else None
        root = self._tracer.start_span(
            f"{run.operation} {run.model}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=_ns(run.received),
            attributes=self._run_attributes(run, facts),
        )
        context = set_span_in_context(root)
        for choice in run.choices:
            for phase in choice.phases:
                self._span(phase, choice, context)
        root.end(end_time=_ns(run.end))

    def _span(self, phase: Phase, choice: ChoiceTimeline, context: Context) -> None:
        attributes: dict[str, AttributeValue] = {
            "pdserve.request.id": choice.request_id,
            "pdserve.clock.error_s": choice.clock_error_s,
            **phase.attributes,
        }
        if phase.instance:
            attributes["pdserve.instance.id"] = phase.instance
        span = self._tracer.start_span(
            phase.name, context=context, start_time=_ns(phase.start), attributes=attributes
        )
        if self.detailed:
            inner = set_span_in_context(span)
            for child in phase.children:
                self._span(child, choice, inner)
        span.end(end_time=_ns(phase.end))

    @staticmethod
    def _run_attributes(run: RunTimeline, facts: RunFacts) -> dict[str, AttributeValue]:
        reasons = [c.finish_reason for c in run.choices]
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": run.operation,
            "gen_ai.request.model": run.model,
            "gen_ai.response.model": run.model,
            "gen_ai.response.id": run.id,
            "gen_ai.response.finish_reasons": reasons,
            **facts.params,
        }
        for key in (FORWARD, EXECUTE):
            # Choices of one run share their steps: the largest, not their sum.
            values = [float(c.model[key]) for c in run.choices if key in c.model]
            if values:
                attributes[key] = max(values)
        return attributes

    def shutdown(self) -> None:
        """Exports what is still queued, then stops."""
        self._provider.shutdown()
