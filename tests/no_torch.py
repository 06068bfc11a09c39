"""Torch made unimportable for a folder of tests whose rooms must run without it.

`sys.modules["torch"] = None` makes `import torch` raise ImportError. A folder's
conftest re-exports the hook and fixture below: torch is unimportable while that
folder's test modules are imported (so the modules they import load without torch)
and while each of its tests runs, and importable in between, because other rooms'
tests share the process when the whole suite runs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest

_ABSENT = object()


@contextlib.contextmanager
def torch_unimportable() -> Iterator[None]:
    saved = sys.modules.get("torch", _ABSENT)
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is _ABSENT:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = saved  # type: ignore[assignment]


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # noqa: ANN201
    with torch_unimportable():
        return (yield)


@pytest.fixture(autouse=True)
def _no_torch() -> Iterator[None]:
    with torch_unimportable():
        yield
