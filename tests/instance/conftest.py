"""The step loop, its I/O and its test hooks run without torch (the model sits behind
the executor seam): torch is unimportable here."""

from tests.no_torch import _no_torch, pytest_make_collect_report  # noqa: F401
