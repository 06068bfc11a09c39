"""The device check's sections, and the process that runs one of them.

    python -m experiments.gpu_sections NAME --status FILE [--dry-run-cpu]

`experiments.gpu_check` starts one such process per section with a time limit of its
own; the process prints the section's table on stdout (the runner sends it to the
section's file as it is written) and writes the `Outcome` to FILE when it ends. A
section needing a package the machine lacks is skipped, naming the package.

The registry is torch-free: the runner reads names and limits without loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from experiments.gpu_outcome import Outcome, SectionSkipped

# What `pdserve serve` and the engine's worker groups import beyond torch and triton
# (experiments/gpu_requirements.txt lists their distributions).
SERVING_MODULES = ("msgspec", "zmq", "fastapi", "uvicorn", "httpx", "safetensors", "tokenizers")
ENGINE_MODULES = ("msgspec", "safetensors", "tokenizers")


@dataclass(frozen=True)
class Section:
    name: str
    entry: str  # "module:function", called with (device, dry_run) -> Outcome
    limit_s: float  # on one H200
    dry_limit_s: float  # on CPU with tiny shapes
    needs: tuple[str, ...] = ()  # modules beyond torch and triton
    interpret_triton: bool = False  # the dry run sets TRITON_INTERPRET=1

    def run(self, device, dry_run: bool) -> Outcome:
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)(device, dry_run)


# The limits add up to the 5 minutes the whole check may take on one H200.
SECTIONS = (
    Section("kernels", "experiments.gpu_kernels:run_section", 70, 60, interpret_triton=True),
    Section("graphs", "experiments.gpu_engine:run_graphs_section", 30, 40),
    Section("decode-step", "experiments.gpu_engine:run_decode_step_section", 70, 40),
    Section("serve", "experiments.gpu_serve:run_section", 80, 120, SERVING_MODULES),
    Section("tensor-parallel", "experiments.gpu_parallel:run_tp_section", 25, 60, ENGINE_MODULES),
    Section("pipeline-parallel", "experiments.gpu_parallel:run_pp_section", 25, 60, ENGINE_MODULES),
)
NAMES = tuple(section.name for section in SECTIONS)


def section_named(name: str) -> Section:
    for section in SECTIONS:
        if section.name == name:
            return section
    raise KeyError(f"no section {name!r}; sections: {', '.join(NAMES)}")


def missing_module(names: tuple[str, ...]) -> str | None:
    """The first of `names` that does not import here, with why."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return f"{name} does not import ({exc}); install the wheels: --wheels DIR"
    return None


def run_in_this_process(section: Section, dry_run: bool) -> Outcome:
    missing = missing_module(section.needs)
    if missing:
        return Outcome.skipped(missing)
    import torch

    if dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny shapes: more threads only spin against each other
    elif not torch.cuda.is_available():
        return Outcome.failed("no CUDA device visible to the section's process")
    else:
        device = torch.device("cuda")
    try:
        return section.run(device, dry_run)
    except SectionSkipped as skip:
        return Outcome.skipped(str(skip))
    except Exception as exc:  # the runner reports it as the section's line
        traceback.print_exc()
        return Outcome.failed(f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.gpu_sections")
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("--status", type=Path, required=True)
    parser.add_argument("--dry-run-cpu", action="store_true")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    outcome = run_in_this_process(section_named(args.name), args.dry_run_cpu)
    print(f"\n({args.name}: {time.perf_counter() - began:.1f} s; {outcome.line(args.name)})")
    sys.stdout.flush()
    outcome.save(args.status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
