"""The eval room runs without torch (unimportable here), against a fake server of tables."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.no_torch import _no_torch, pytest_make_collect_report  # noqa: F401
from tests.printed_port import printed_port_server, refused_url  # noqa: F401


class TableServer:
    """Handle on the table server subprocess: one fake OpenAI server per table name."""

    def __init__(self, root: str) -> None:
        self.root = root

    def serve(self, name: str, replies: dict[str, str], default: str = "", **more) -> str:
        """Set table `name`; returns its OpenAI base URL."""
        table = {"replies": replies, "default": default, **more}
        httpx.put(f"{self.root}/tables/{name}", json=table, timeout=5).raise_for_status()
        return f"{self.root}/{name}"

    def requests(self, name: str) -> list[dict]:
        return httpx.get(f"{self.root}/tables/{name}/requests", timeout=5).json()


@pytest.fixture(scope="session")
def table_server() -> Iterator[TableServer]:
    with printed_port_server("tests.eval.table_server", "/tables/none/requests") as base_url:
        yield TableServer(base_url)
