"""deploy/prometheus/alerts.yaml: promtool accepts the rules and passes their unit
tests (alerts_test.yaml), every rule is tested firing and silent, and every series
and label the rules name is one the gateway's `/metrics` exports, so the rules cannot
drift from the code. The live server's scrape is checked in
tests/gateway/test_deployment_metrics.py."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from pdserve.gateway.deployment_metrics import PoolCount
from pdserve.gateway.metrics import GatewayMetrics
from tests.deploy.rules import (
    RULE_TESTS,
    RULES,
    TARGET_LABELS,
    labels_in,
    rules,
)
from tests.gateway.exported_series import exported_series, series_in

SEVERITIES = {"critical", "warning", "info"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not on PATH: `make install` installs it as root (Debian's "
            "prometheus package), or `apt-get install prometheus`"
        )
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_rule_is_tested_firing_and_silent() -> None:
    fired, silent = set(), set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {rule["alert"] for rule in rules()}
    assert names - fired == set(), "rules never tested firing"
    assert names - silent == set(), "rules never tested silent"


def test_every_rule_has_a_severity_a_summary_and_a_description() -> None:
    for rule in rules():
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]


def exported() -> dict[str, set[str]]:
    """Series family -> label names, as `/metrics` shows them once instances and pools
    are known and `--ttft-slo-ms` is set."""
    metrics = GatewayMetrics(model_name="m")
    for role in ("prefill", "decode", "colocated"):
        metrics.add_instance(role, f"{role}-0")
        metrics.deployment.set_max_num_seqs(role, f"{role}-0", 8)
    metrics.deployment.set_ttft_slo(1.0)
    metrics.deployment.watch_pools(lambda: {"decode": PoolCount(size=2, up=1)})
    return exported_series(metrics)


def test_every_series_and_label_the_rules_name_is_exported() -> None:
    series = exported()
    for rule in rules():
        expr = rule["expr"]
        names = series_in(expr)
        assert names, f"{rule['alert']}: no pdserve or vLLM series in {expr!r}"
        assert names <= series.keys(), f"{rule['alert']}: /metrics lacks {names - series.keys()}"
        carried = set().union(*(series[n] for n in names)) | TARGET_LABELS | {"le"}
        assert labels_in(expr) <= carried, f"{rule['alert']}: labels its series lack"
