"""How one section of the device check ended: ok, skipped or FAILED, with a reason.

Torch-free: the runner (`experiments.gpu_check`) reads outcomes back from the files its
section processes write, before or without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

STATUSES = ("ok", "skipped", "FAILED")


@dataclass(frozen=True)
class Outcome:
    status: str  # one of STATUSES
    reason: str = ""

    @classmethod
    def ok(cls) -> Outcome:
        return cls("ok")

    @classmethod
    def skipped(cls, reason: str) -> Outcome:
        return cls("skipped", _one_line(reason))

    @classmethod
    def failed(cls, reason: str) -> Outcome:
        return cls("FAILED", _one_line(reason))

    def line(self, name: str) -> str:
        """`section NAME: ok`, `section NAME: skipped (REASON)`, `section NAME: FAILED (REASON)`."""
        return f"section {name}: {self.status}" + (f" ({self.reason})" if self.reason else "")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Outcome | None:
        """The outcome a section process wrote, or None when it wrote none."""
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(found, dict) or found.get("status") not in STATUSES:
            return None
        return cls(found["status"], str(found.get("reason", "")))


class SectionSkipped(Exception):
    """Raised inside a section: the machine cannot run it (the message says why)."""


def _one_line(text: str) -> str:
    return " ".join(text.split())[:400]
