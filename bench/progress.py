"""A plain-text progress line on stderr: done/total, failures, elapsed time."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30


class ProgressBar:
    def __init__(
        self,
        total: int,
        label: str = "requests",
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.failed = 0
        self.started = time.monotonic()
        self.last_drawn = 0.0

    def advance(self, success: bool) -> None:
        self.done += 1
        self.failed += 0 if success else 1
        now = time.monotonic()
        # Redraw at most 10 times a second, and always at the end.
        if now - self.last_drawn >= 0.1 or self.done == self.total:
            self.last_drawn = now
            self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        filled = BAR_WIDTH * self.done // max(1, self.total)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        elapsed = time.monotonic() - self.started
        failed = f", {self.failed} failed" if self.failed else ""
        self.stream.write(
            f"\r[{bar}] {self.done}/{self.total} {self.label}{failed} {elapsed:6.1f} s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()
