"""deploy/prometheus/alerts.yaml as the tests read it: its rules and the series and
labels their expressions name."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yaml"
RULE_TESTS = PROMETHEUS / "alerts_test.yaml"
# Series names: PromQL's functions, keywords and label names never hold a colon.
_SERIES = re.compile(r"\b(?:vllm|pdserve):[a-zA-Z0-9_:]*")
_MATCHING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels Prometheus adds to every scraped series (the target's), not pdserve's.
TARGET_LABELS = {"job", "instance"}


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def series_in(expr: str) -> set[str]:
    """The families an expression reads (a histogram's `_bucket` is its family)."""
    names = set()
    for name in _SERIES.findall(expr):
        for suffix in _SUFFIXES:
            name = name.removesuffix(suffix)
        names.add(name)
    return names


def labels_in(expr: str) -> set[str]:
    """Label names in `by`, `without`, `on` and `ignoring` clauses."""
    return {label.strip() for group in _MATCHING.findall(expr) for label in group.split(",")} - {""}
