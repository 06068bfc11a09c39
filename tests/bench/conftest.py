from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.printed_port import printed_port_server, refused_url  # noqa: F401


class ScriptedServer:
    """Handle on the scripted server subprocess: set its script, read its counters."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def script(self, **settings: object) -> None:
        httpx.post(f"{self.base_url}/script", json=settings, timeout=5).raise_for_status()

    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/stats", timeout=5).json()


@pytest.fixture(scope="session")
def scripted_server() -> Iterator[ScriptedServer]:
    with printed_port_server("tests.bench.scripted_server", "/v1/models") as base_url:
        yield ScriptedServer(base_url)
