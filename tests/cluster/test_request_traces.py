"""One prefill and two decode instances (local processes, `--collect-detailed-traces all`)
exporting traces over OTLP/HTTP to a receiver in this process: each disaggregated
request's phases tile its end-to-end time (timeline endpoint and trace alike; the queue
starts when the prefill instance received the task), the prefill and decode spans and
the root carry the instances' model seconds (forward ≤ execute ≤ the span), the
handoff's bytes are what `kv_transfer_bytes_total` grew by, the client's `traceparent`
is the root's parent, the phases are histograms in `/metrics`, and a request whose
decode instance is killed mid-stream shows its migration.

The tests run in file order on one server; the last one kills a decode instance.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from collections.abc import Iterator

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from experiments.otlp_receiver import OTLPReceiver
from experiments.serving import ADMIN_KEY, LOCAL, MODEL, BackgroundStream, ServeProcess, served

pytestmark = pytest.mark.slow

ARGS = (
    *LOCAL, "--num-prefill", "1", "--num-decode", "2", "--dtype", "bfloat16",
    "--kv-cache-memory", "32MiB", "--max-model-len", "1024", "--collect-detailed-traces", "all",
)  # fmt: skip
PROMPT = "Once upon a time, in a land far away, there lived a dragon who"
# Distinct from their first token: no decode instance finds any of their blocks cached.
PROMPTS = [
    "The capital of France is a city that many people visit every year because",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "Water boils at one hundred degrees Celsius at sea level, but on a high mountain",
]
TILE_TOLERANCE = 0.05
FORWARD = "gen_ai.latency.time_in_model_forward"
EXECUTE = "gen_ai.latency.time_in_model_execute"
COMPUTE = ("prefill", "decode")
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as found:
        yield found


@pytest.fixture(scope="module")
def server(receiver: OTLPReceiver) -> Iterator[ServeProcess]:
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    with served(*ARGS, "--otlp-traces-endpoint", receiver.url, env=env) as process:
        yield process


def decode_bytes(server: ServeProcess) -> float:
    text = server.get("/metrics").text
    pattern = r'^pdserve:kv_transfer_bytes_total{[^}]*role="decode"[^}]*} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def timeline(server: ServeProcess, request_id: str) -> dict:
    response = server.get(f"/admin/requests/{request_id}/timeline", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def assert_tiles(choice: dict) -> None:
    """The phases cover the end-to-end time within 5%, without overlapping beyond the
    clocks' uncertainty (two instances' errors may add up)."""
    phases = sorted(choice["phases"], key=lambda p: p["start"])
    e2e = choice["e2e_s"]
    covered = sum(p["end"] - p["start"] for p in phases)
    assert abs(covered - e2e) <= TILE_TOLERANCE * e2e, (covered, e2e, phases)
    slack = 2 * choice["clock_error_s"] + 1e-4
    for before, after in zip(phases, phases[1:], strict=False):
        assert before["end"] - after["start"] <= slack, (before, after, slack)
        assert after["end"] >= after["start"]


def assert_model_time(choice: dict) -> None:
    """Each compute span carries its instance's model seconds for the request, within
    the span (one instance's clock; the clocks' error allowed), and the choice's sums
    within its end-to-end time."""
    slack = choice["clock_error_s"] + 1e-6
    for phase in choice["phases"]:
        if phase["name"] in COMPUTE:
            forward, execute = phase["attributes"][FORWARD], phase["attributes"][EXECUTE]
            assert 0 < forward <= execute <= phase["end"] - phase["start"] + slack, phase
    total = choice["model"]
    assert 0 < total[FORWARD] <= total[EXECUTE] <= choice["e2e_s"], total


def test_disaggregated_phases_tile_the_request_and_the_handoff_counts_its_bytes(server) -> None:
    client = server.openai()
    for prompt in PROMPTS:
        before = decode_bytes(server)
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        moved = decode_bytes(server) - before
        run = timeline(server, result.id)
        (choice,) = run["choices"]
        names = [p["name"] for p in choice["phases"]]
        assert names == ["admission", "queue", "prefill", "handoff", "decode", "detokenize"]
        assert_tiles(choice)
        assert_model_time(choice)
        handoff = next(p for p in choice["phases"] if p["name"] == "handoff")
        assert handoff["attributes"]["pdserve.kv.bytes"] == moved > 0
        assert handoff["attributes"]["pdserve.kv.blocks"] >= 1
        assert {c["name"] for c in handoff["children"]} == {"kv_seat_wait", "kv_transfer"}
        assert choice["output_tokens"] == result.usage.completion_tokens


def test_the_trace_is_the_clients_and_carries_the_same_phases(server, receiver) -> None:
    trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
    traceparent = f"00-{trace_id.hex()}-{parent_id.hex()}-01"
    result = server.openai().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_headers={"traceparent": traceparent},
    )
    spans = receiver.trace(trace_id)
    (root,) = [s for s in spans if s.kind == Span.SPAN_KIND_SERVER]
    assert root.parent_span_id == parent_id
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["gen_ai.operation.name"].string_value == "text_completion"
    assert attributes["gen_ai.response.id"].string_value == result.id
    assert attributes["gen_ai.usage.output_tokens"].int_value == result.usage.completion_tokens
    phases = [s for s in spans if s.parent_span_id == root.span_id]
    names = sorted(s.name for s in phases)
    assert names == sorted(["admission", "queue", "prefill", "handoff", "decode", "detokenize"])
    e2e = root.end_time_unix_nano - root.start_time_unix_nano
    covered = sum(s.end_time_unix_nano - s.start_time_unix_nano for s in phases)
    assert abs(covered - e2e) <= TILE_TOLERANCE * e2e
    forward, execute = attributes[FORWARD].double_value, attributes[EXECUTE].double_value
    assert 0 < forward <= execute <= e2e / 1e9
    for span in (s for s in phases if s.name in COMPUTE):
        seconds = {a.key: a.value.double_value for a in span.attributes}
        length = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
        slack = seconds["pdserve.clock.error_s"] + 1e-6  # the span's ends: whole ns
        assert 0 < seconds[FORWARD] <= seconds[EXECUTE] <= length + slack, span.name
    handoff = next(s for s in phases if s.name == "handoff")
    children = {s.name for s in spans if s.parent_span_id == handoff.span_id}
    assert children == {"kv_seat_wait", "kv_transfer"}
    stored = timeline(server, result.id)
    assert stored["traceparent"] == traceparent


def test_phases_are_histograms_in_metrics(server) -> None:
    text = server.get("/metrics").text
    for phase in ("admission", "queue", "prefill", "handoff", "kv_transfer", "decode"):
        pattern = rf'^pdserve:request_phase_seconds_count{{phase="{phase}"}} (\S+)$'
        counts = re.findall(pattern, text, re.MULTILINE)
        assert counts and float(counts[0]) >= 4, phase


def test_an_unknown_request_has_no_timeline(server) -> None:
    response = server.get("/admin/requests/cmpl-nope/timeline", headers=ADMIN)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_a_migrated_request_shows_its_migration(server, receiver) -> None:
    trace_id = secrets.token_bytes(16)
    body = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    stream = BackgroundStream(
        server, body, headers={"traceparent": f"00-{trace_id.hex()}-{'1' * 16}-01"}
    )
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        if len(stream.chunks) >= 3:
            for books in server.instances().values():
                if books["role"] == "decode" and books["in_flight"]:
                    victim = books["pid"]
        time.sleep(0.05)
    assert victim is not None, "the stream never reached its decode instance"
    os.kill(victim, signal.SIGKILL)
    stream.join(timeout_s=180)
    assert not stream.errors, stream.errors
    spans = receiver.trace(trace_id, timeout_s=60)
    names = [s.name for s in spans]
    assert "migration" in names, names
    migration = next(s for s in spans if s.name == "migration")
    attributes = {a.key: a.value for a in migration.attributes}
    assert attributes["pdserve.move.tokens_carried"].int_value >= 3
