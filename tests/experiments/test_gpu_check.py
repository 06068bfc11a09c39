"""The device check runs every section's code on CPU (`--dry-run-cpu`): one status line
per section, its table in --out; a section over its time limit is killed and reported
FAILED while the others still run; without CUDA the real run refuses in one line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.experiments.without_cuda import REPO, run_without_cuda

SECTIONS = ("kernels", "graphs", "decode-step", "serve", "tensor-parallel", "pipeline-parallel")
LINE = re.compile(r"^section (\S+): (ok|skipped \(.+\)|FAILED \(.+\))$")


def gpu_check(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.gpu_check", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def section_lines(stdout: str) -> dict[str, str]:
    found = [LINE.match(line) for line in stdout.splitlines()]
    return {m.group(1): m.group(2) for m in found if m}


@pytest.mark.slow
def test_dry_run_passes_every_section_and_writes_its_table(tmp_path):
    out = tmp_path / "out"
    done = gpu_check(
        "--dry-run-cpu", "--jobs", "6", "--time-limit-scale", "4", "--out", str(out),
        timeout_s=900,
    )  # fmt: skip
    assert section_lines(done.stdout) == dict.fromkeys(SECTIONS, "ok"), done.stdout + done.stderr
    assert done.returncode == 0
    tables = {name: (out / f"{name}.txt").read_text() for name in SECTIONS}
    assert "0 token mismatches" in tables["graphs"]
    assert re.search(r"^\s+(\d+)/\1 kernel checks passed$", tables["kernels"], re.M)
    assert "prefill of 64 tokens" in tables["decode-step"]
    for transport in ("ucx", "zmq"):
        assert re.search(rf"^  {transport}\s+3/3\s+[\d,]+\s", tables["serve"], re.M), tables[
            "serve"
        ]
    for name in ("tensor-parallel", "pipeline-parallel"):
        rows = [line.split() for line in tables[name].splitlines() if line[:8].strip().isdigit()]
        assert [row[2] for row in rows] == ["yes"] * 3, tables[name]


def test_a_section_over_its_limit_is_killed_and_the_next_still_runs(tmp_path):
    done = gpu_check(
        "--dry-run-cpu", "--only", "graphs", "serve", "--time-limit-scale", "0.02",
        "--out", str(tmp_path), timeout_s=60,
    )  # fmt: skip
    lines = section_lines(done.stdout)
    assert lines == {
        "graphs": "FAILED (over its time limit of 1 s; killed)",
        "serve": "FAILED (over its time limit of 2 s; killed)",
    }, done.stdout + done.stderr
    assert done.returncode == 1
    assert (tmp_path / "serve.txt").exists() and (tmp_path / "graphs.log").exists()


# Absent on the GPU machine until its wheels are installed: the first three sections
# must not need them, the others must say which one they miss.
BLOCKED = ("msgspec", "zmq", "ray", "ucxx", "fastapi", "safetensors", "transformers")


@pytest.mark.slow
def test_engine_sections_need_only_torch_and_the_rest_name_what_is_missing(tmp_path):
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name in BLOCKED:
        (stubs / f"{name}.py").write_text(f"raise ImportError('{name} is not on this machine')\n")
    argv = ["gpu_check", "--dry-run-cpu", "--jobs", "3", "--time-limit-scale", "4", "--only",
            "graphs", "decode-step", "tensor-parallel", "--out", str(tmp_path)]  # fmt: skip
    code = (
        "import os, sys, runpy\n"
        f"os.environ['PYTHONPATH'] = {str(stubs)!r}\n"
        f"sys.argv = {argv!r}\n"
        "runpy.run_module('experiments.gpu_check', run_name='__main__')\n"
    )
    done = run_without_cuda(code, timeout_s=300)
    lines = section_lines(done.stdout)
    assert lines["graphs"] == "ok" and lines["decode-step"] == "ok", done.stdout + done.stderr
    assert lines["tensor-parallel"].startswith("skipped (msgspec does not import")
    decode = (tmp_path / "decode-step.txt").read_text()
    rows = [line.split() for line in decode.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 4]  # one decode row per batch size
    assert "transformers not installed" in decode


@pytest.mark.slow
def test_gpu_check_reports_no_cuda_in_one_line():
    # Importing the kernel half first proves every import of the device script resolves.
    code = (
        "import experiments.gpu_kernels, runpy\n"
        "runpy.run_module('experiments.gpu_check', run_name='__main__')\n"
    )
    done = run_without_cuda(code, timeout_s=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "gpu_check: no CUDA device available (torch.cuda.is_available() is False); "
        "run it on a GPU machine"
    ]


def test_the_step_profile_runs_on_cpu_and_names_the_model_kernels():
    done = subprocess.run(
        [sys.executable, "-m", "experiments.gpu_profile", "--dry-run-cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "decode step, batch 4, context 48" in done.stdout
    assert "prefill of 64 tokens" in done.stdout
    # CPU tensors never run the CUDA operator (their activation is a C kernel, which
    # torch's profiler does not see, or the reference where the C kernels are off).
    assert "pdserve::silu_and_mul" not in done.stdout
    assert "aten::embedding" in done.stdout  # the model's own ops are named
