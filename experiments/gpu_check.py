"""Device check, one command on a machine with one CUDA GPU (sized for one H200):

    python -m experiments.gpu_check --wheels wheels --out results/gpu

Sections, each in a process of its own under a time limit of its own (a hang costs its
limit, not the run): `kernels` (every Triton kernel against its torch reference, then
decode-attention bandwidth and prefill TFLOP/s), `graphs` (greedy tokens of the engine
with CUDA graphs equal to eager torch references), `decode-step` (the 8B-shaped decode
step at batch 1/16/64 against 5.0 ms at batch 1 and 6.5 ms at batch 64, a 4096-token
prefill against 110 ms: a missed target fails the section), `serve` (`pdserve serve
--launcher local`, 1 prefill + 1 decode sharing the GPU, KV over UCX in CUDA memory and
over the zmq copy, greedy text equal to a colocated server's, KV bytes per request and
handoff time), `tensor-parallel` and `pipeline-parallel` (two ranks against one, where
the GPUs allow two ranks; else skipped with the reason).

Each section prints one line, `section NAME: ok`, `section NAME: skipped (REASON)` or
`section NAME: FAILED (REASON)`, and leaves its table in OUT/NAME.txt (written as it
runs, so a section that hangs still leaves what it printed) and its stderr in
OUT/NAME.log. `--only NAME [NAME ...]` runs those sections alone. Exit status 1 when a
section FAILED. The limits add up to the 5 minutes the whole check may take
(`experiments/gpu_sections.py`); `--time-limit-scale 2` doubles them for a rerun.

The machine has torch and triton and no network: kernels, graphs and decode-step need
nothing else; serve and the parallel sections need the packages of
`experiments/gpu_requirements.txt`, which `experiments/gpu_wheels.sh DIR` downloads
where there is network (cp312 manylinux wheels, packed into DIR/wheels.tar.xz to fit
what travels with the checkout). `--wheels DIR` unpacks and installs them first
(`pip install --no-index --find-links`); without them those sections are skipped,
naming the missing package. The repository runs from a bare checkout
(`pdserve/__init__.py` finds the rooms beside it).

`--dry-run-cpu` runs every section's code on CPU with tiny shapes, no graph capture and
Triton under its interpreter (`TRITON_INTERPRET=1`): the proof that the code executes
(`tests/experiments/test_gpu_check.py`); it measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments.gpu_outcome import Outcome
from experiments.gpu_sections import NAMES, SECTIONS, Section

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "experiments" / "gpu_requirements.txt"


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check: no CUDA device available (torch.cuda.is_available() is False); "
            "run it on a GPU machine"
        )


def install_wheels(folder: Path) -> Outcome:
    """pip installs the serving packages from `folder`, offline: from the wheels.tar.xz
    that `experiments/gpu_wheels.sh` writes there (unpacked to a temporary folder), or
    from wheels lying in the folder itself."""
    packed = folder / "wheels.tar.xz"
    with tempfile.TemporaryDirectory(prefix="pdserve-wheels-") as unpacked:
        if packed.is_file():
            with tarfile.open(packed) as archive:
                archive.extractall(unpacked, filter="data")
            folder = Path(unpacked)
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                   "--find-links", str(folder), "-r", str(REQUIREMENTS)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Outcome.failed(f"pip exited {done.returncode}: {last}")
    return Outcome.ok()


def section_env(section: Section, dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if dry_run and section.interpret_triton:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_section(section: Section, out: Path, dry_run: bool, scale: float) -> Outcome:
    """One section in a child process (its own process group, killed whole at its limit)."""
    limit_s = (section.dry_limit_s if dry_run else section.limit_s) * scale
    status = out / f"{section.name}.status.json"
    status.unlink(missing_ok=True)
    command = [sys.executable, "-m", "experiments.gpu_sections", section.name,
               "--status", str(status)] + (["--dry-run-cpu"] if dry_run else [])  # fmt: skip
    table_path, log_path = out / f"{section.name}.txt", out / f"{section.name}.log"
    with open(table_path, "w") as table, open(log_path, "w") as log:
        child = subprocess.Popen(
            command, cwd=REPO, env=section_env(section, dry_run), stdout=table, stderr=log,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            code = child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return Outcome.failed(f"over its time limit of {limit_s:.0f} s; killed")
        finally:
            _kill_leftovers(child.pid)
    found = Outcome.load(status)
    if found is not None:
        return found
    return Outcome.failed(f"its process exited {code} without an outcome; see {log_path}")


def _kill_leftovers(group: int) -> None:
    """Servers a section started and did not stop die with its process group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--out", type=Path, default=REPO / "results" / "gpu-check",
        help="folder for each section's table (NAME.txt) and stderr (NAME.log)")  # fmt: skip
    add("--only", nargs="+", choices=NAMES, metavar="NAME",
        help=f"run these sections only: {', '.join(NAMES)}")  # fmt: skip
    add("--wheels", type=Path, default=None,
        help="pip install experiments/gpu_requirements.txt from here, offline")  # fmt: skip
    add("--dry-run-cpu", action="store_true",
        help="every section's code on CPU, tiny shapes, no capture (measures nothing)")  # fmt: skip
    add("--jobs", type=int, default=1,
        help="sections at once (dry run only: on a GPU they skew each other)")  # fmt: skip
    add("--time-limit-scale", type=float, default=1.0,
        help="multiplies every section's time limit")  # fmt: skip
    return parser.parse_args(argv)


def run_sections(sections: list[Section], args: argparse.Namespace) -> list[Outcome]:
    """Each section's line as soon as it ends (in the order they end, with --jobs)."""

    def one(section: Section) -> Outcome:
        outcome = run_section(section, args.out, args.dry_run_cpu, args.time_limit_scale)
        print(outcome.line(section.name), flush=True)
        return outcome

    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(one, sections))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.jobs > 1 and not args.dry_run_cpu:
        raise SystemExit("gpu_check: --jobs applies to --dry-run-cpu only")
    if not args.dry_run_cpu:
        require_cuda()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    if args.wheels is not None:
        installed = install_wheels(args.wheels)
        print(f"wheels from {args.wheels}: {installed.status} {installed.reason}", flush=True)
    outcomes = run_sections([s for s in SECTIONS if not args.only or s.name in args.only], args)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "skipped", "FAILED")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    print(f"gpu_check: {summary} in {time.perf_counter() - began:.0f} s; tables in {args.out}")
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
