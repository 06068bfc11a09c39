"""`pdserve eval compare`'s run: the same items, greedy and seeded, against a baseline and
a candidate server at once, each with its own bound on requests in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.eval.client import EvalClient, Reply
from pdserve.eval.items import EvalItem
from pdserve.eval.summary import summarize


@dataclass(frozen=True)
class Server:
    """One side of the comparison: where it is, which model (None: its first one), its key."""

    url: str
    model: str | None = None
    api_key: str | None = None


@dataclass(frozen=True)
class CompareConfig:
    seed: int = 0
    max_concurrency: int = 8
    timeout_s: float = 120.0


async def ask_all(client: EvalClient, items: Sequence[EvalItem], model: str) -> list[Reply]:
    return list(await asyncio.gather(*(client.ask(item, model) for item in items)))


async def run_compare(
    items: Sequence[EvalItem], baseline: Server, candidate: Server, config: CompareConfig
) -> dict:
    """Every item against both servers; the summary (`summary.summarize`) with what ran."""
    servers = {"baseline": baseline, "candidate": candidate}
    clients = {
        side: EvalClient(
            server.url,
            api_key=server.api_key,
            timeout_s=config.timeout_s,
            max_concurrency=config.max_concurrency,
            seed=config.seed,
        )
        for side, server in servers.items()
    }
    try:
        models = {
            side: servers[side].model or await client.first_model()
            for side, client in clients.items()
        }
        replies = await asyncio.gather(
            *(ask_all(clients[side], items, models[side]) for side in clients)
        )
    finally:
        for client in clients.values():
            await client.close()
    summary = summarize(items, dict(zip(clients, replies, strict=True)))
    runs = {side: {"url": servers[side].url, "model": models[side]} for side in servers}
    return {**runs, "seed": config.seed, "temperature": 0.0, **summary}
