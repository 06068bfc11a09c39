"""The real-server mode of the SLO benchmark: the trace as a replayable dataset, and the
scoring of a replay's per-request outcomes by phase against the SLOs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.slo_real import score, write_trace
from experiments.slo_trace import TraceRequest, phase_windows

SCALE = 0.1


def test_the_trace_becomes_a_jsonl_dataset_with_timestamps(tmp_path: Path) -> None:
    trace = [TraceRequest(0.5, 3, 7, "chat"), TraceRequest(1.25, 5, 2, "rag")]
    path = tmp_path / "trace.jsonl"
    write_trace(trace, path, seed=1)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [len(r["prompt"]) for r in records] == [3, 5]
    assert [(r["output_len"], r["timestamp"]) for r in records] == [(7, 0.5), (2, 1.25)]


def test_a_replay_is_scored_by_phase_against_both_slos() -> None:
    chat_end = phase_windows(SCALE)[0][2]
    trace = [
        TraceRequest(0.1, 10, 3, "chat"),  # meets both
        TraceRequest(0.2, 10, 3, "chat"),  # too slow between tokens
        TraceRequest(chat_end + 0.1, 10, 3, "rag"),  # first token too late
        TraceRequest(chat_end + 0.2, 10, 3, "rag"),  # failed
    ]
    result = {
        "ttfts": [0.5, 0.5, 3.0, 0.0],
        "itls": [[0.05, 0.05], [0.3, 0.3], [0.05, 0.05], []],
        "output_lens": [3, 3, 3, 0],
        "errors": ["", "", "", "HTTP 500"],
    }
    rows = {r["phase"]: r for r in score(result, trace, SCALE, (2000.0, 100.0), [chat_end + 1])}
    assert rows["chat"]["attainment"] == 0.5 and rows["chat"]["failed"] == 0
    assert rows["chat"]["goodput"] == pytest.approx(1 / chat_end)
    assert rows["rag"]["attainment"] == 0.0 and rows["rag"]["failed"] == 1
    assert rows["rag"]["decisions"] == 1 and rows["chat"]["decisions"] == 0
    assert rows["all"]["requests"] == 4 and rows["all"]["ttft_p50"] == pytest.approx(500.0)
