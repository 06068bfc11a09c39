"""Python child processes run in the repository's root, where `pdserve` and `tests` import
as they do in the test process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(
    *args: str, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with the test process's interpreter in the repository root, its output
    captured as text (`env`: the child's whole environment, else the test process's)."""
    command = [sys.executable, *args]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
