"""`pdserve serve --autoscale slo`'s flags and the controller settings they make, without
starting anything: the defaults, and every refusal in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.serving import MODEL
from pdserve.cli import build_parser
from pdserve.cluster.deployment import Deployment, ServeError

STEPS = [
    {"batch_tokens": n, "attention_pairs": n * n, "seconds": 0.001 + n * 1e-5} for n in (1, 8, 64)
]  # a step-latency model's measurements, as `pdserve bench calibrate` writes
CORES = list(range(8))


@pytest.fixture
def calibration(tmp_path: Path) -> str:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"prefill": STEPS, "decode": STEPS, "tp": 1, "model": MODEL}))
    return str(path)


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pdserve.cli", "serve", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def plan(*argv: str) -> Deployment:
    return Deployment.from_args(build_parser().parse_args(["serve", *argv]), cores=CORES)


def slo(calibration: str, *more: str) -> tuple[str, ...]:
    return ("--num-decode", "2", "--autoscale", "slo", "--ttft-slo-ms", "800",
            "--itl-slo-ms", "40", "--calibration", calibration, *more)  # fmt: skip


def test_off_by_default_and_the_controllers_defaults(calibration: str) -> None:
    assert plan().autoscale is None
    config = plan(*slo(calibration)).autoscale
    assert config is not None
    policy = config.policy
    assert (policy.instance_budget, policy.ttft_slo_ms, policy.itl_slo_ms) == (3, 800.0, 40.0)
    assert (policy.min_prefill, policy.max_prefill, policy.min_decode, policy.max_decode) == (
        1, None, 1, None)  # fmt: skip
    assert policy.interval_s == 5.0 and config.calibration.model == MODEL
    flags = ("--instance-budget", "5", "--max-prefill", "3", "--min-decode", "2",
             "--autoscale-interval-s", "2")  # fmt: skip
    policy = plan(*slo(calibration, *flags)).autoscale.policy  # type: ignore[union-attr]
    assert (policy.instance_budget, policy.max_prefill, policy.min_decode) == (5, 3, 2)
    assert policy.interval_s == 2.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ttft-slo-ms", "800"], "--autoscale slo needs --itl-slo-ms"),
        (["--itl-slo-ms", "40", "--ttft-slo-ms", "800"], "needs --calibration FILE"),
        (["--itl-slo-ms", "40"], "--autoscale slo needs --ttft-slo-ms"),
    ],
)
def test_slo_needs_both_objectives_and_a_calibration(flags: list[str], message: str) -> None:
    with pytest.raises(ServeError, match=message):
        plan("--autoscale", "slo", *flags)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mode", "colocated"], "not --mode colocated"),
        (["--instance-budget", "1"], "--instance-budget 1 is below --min-prefill + --min-decode"),
        (["--instance-budget", "2"], "--instance-budget 2 is below the 3 instances started"),
        (["--min-decode", "3", "--max-decode", "2"], "--max-decode 2 is below --min-decode 3"),
        (
            ["--min-decode", "3", "--instance-budget", "5"],
            "--num-decode 2 is outside --min-decode 3",
        ),
        (["--min-prefill", "0"], "--min-prefill must be at least 1"),
        (["--max-prefill", "9", "--max-pool-size", "4"], "above the pool's --max-pool-size 4"),
        (["--instance-budget", "9", "--max-pool-size", "4"], "above what the pools may hold (8"),
        (["--autoscale-interval-s", "0"], "--autoscale-interval-s must be a positive"),
        (["--itl-slo-ms", "-1"], "--itl-slo-ms must be a positive number"),
    ],
)
def test_settings_it_cannot_run_with_are_refused(
    calibration: str, flags: list[str], message: str
) -> None:
    with pytest.raises(ServeError, match=re.escape(message)):
        plan(*slo(calibration), *flags)


def test_a_bad_calibration_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ServeError, match="--calibration: .*invalid JSON"):
        plan(*slo(str(bad)))
    with pytest.raises(ServeError, match="calibration file not found"):
        plan(*slo(str(tmp_path / "none.json")))


@pytest.mark.parametrize(
    "flags",
    [["--instance-budget", "4"], ["--min-prefill", "1"], ["--itl-slo-ms", "40"],
     ["--calibration", "x.json"], ["--autoscale-interval-s", "1"]],
)  # fmt: skip
def test_the_controllers_flags_without_it_are_refused(flags: list[str]) -> None:
    with pytest.raises(ServeError, match=f"{flags[0]} is the SLO controller's"):
        plan(*flags)


def test_a_refusal_is_one_line_on_the_command_line() -> None:
    result = run_cli("--autoscale", "slo", "--ttft-slo-ms", "800")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pdserve serve: error: --autoscale slo needs --itl-slo-ms"
    ]
