"""A gateway's HTTP app asked in process, over httpx's ASGI transport: no socket opens
and no instance runs, so route tests stay fast."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import NamedTuple

import httpx

from pdserve.gateway.app import create_app
from pdserve.gateway.gateway import Gateway, GatewayConfig


class Call(NamedTuple):
    method: str
    path: str
    headers: dict[str, str] | None = None
    body: bytes | None = None


@contextlib.asynccontextmanager
async def app_client(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the gateway's app; the gateway is closed when the block ends."""
    transport = httpx.ASGITransport(app=create_app(gateway))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client
    finally:
        await gateway.close()


def gateway_answers(config: GatewayConfig, calls: Iterable[Call]) -> list[httpx.Response]:
    """A fresh gateway's answers to `calls`, in order."""

    async def ask() -> list[httpx.Response]:
        async with app_client(Gateway(config)) as client:
            return [
                await client.request(c.method, c.path, headers=c.headers, content=c.body)
                for c in calls
            ]

    return asyncio.run(ask())
