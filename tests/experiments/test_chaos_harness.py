"""The chaos harness's reading of /metrics and its table (the scenarios themselves run
in tests/cluster/test_chaos.py)."""

from __future__ import annotations

from experiments.chaos import table
from experiments.chaos_harness import Row, counts, read_counters

METRICS = """\
# HELP pdserve:requests_migrated_total Requests whose instance died mid-stream
# TYPE pdserve:requests_migrated_total counter
pdserve:requests_migrated_total 3.0
pdserve:requests_migrated_created 1.7e9
pdserve:num_instances_fenced_total{instance="decode-0",role="decode"} 1.0
pdserve:num_instances_fenced_total{instance="decode-1",role="decode"} 2.0
pdserve:kv_transfer_recomputed_requests_total{instance="decode-0",role="decode"} 4.0
"""


def test_counters_sum_over_their_labels_and_default_to_zero() -> None:
    found = read_counters(METRICS)
    assert (found["migrated"], found["fenced"], found["recomputed"]) == (3.0, 3.0, 4.0)
    assert found["restarted"] == 0.0  # absent: none yet


def test_usage_compares_token_counts_only() -> None:
    cached = {
        "prompt_tokens": 6,
        "completion_tokens": 32,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert counts(cached) == counts({"prompt_tokens": 6, "completion_tokens": 32}) == (6, 32)
    assert counts(None) is None


def test_the_table_has_a_row_per_scenario() -> None:
    rows = [Row("kill decode mid-decode", sent=9, completed=9, migrated=2, pools_full_s=7.25),
            Row("stuck", sent=1, lost=1)]  # fmt: skip
    lines = table(rows).splitlines()
    assert lines[0].startswith("| scenario | sent | completed | migrated |")
    assert lines[2] == "| kill decode mid-decode | 9 | 9 | 2 | 0 | 0 | 0 | 0 | 0 | 7.2 |"
    assert lines[3].endswith("| not within limit |")
