"""The module-scoped gateway socket of the in-process instance tests (prefill and decode)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.prefill.instances import Gateway


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gateway = Gateway()
    yield gateway
    gateway.close()
