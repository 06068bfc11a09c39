"""The common room must work without torch: it is unimportable here."""

from tests.no_torch import _no_torch, pytest_make_collect_report  # noqa: F401
