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
_MATCHING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
# Labels Prometheus adds to every scraped series (the target's), not pdserve's.
TARGET_LABELS = {"job", "instance"}


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def labels_in(expr: str) -> set[str]:
    """Label names in `by`, `without`, `on` and `ignoring` clauses."""
    return {label.strip() for group in _MATCHING.findall(expr) for label in group.split(",")} - {""}
