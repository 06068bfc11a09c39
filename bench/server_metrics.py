"""Reading a server's Prometheus `/metrics` during a sweep step.

KV-cache usage is a gauge, so it is polled and its peak kept; preemptions are a
counter, so the step reports the increase between its start and its end. pdserve's
names come first; vLLM's are understood too so any vLLM-compatible server can be swept.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pdserve.bench.auth import auth_headers

KV_USAGE_NAMES = (
    "pdserve:kv_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)
PREEMPTION_NAMES = ("pdserve:num_preemptions_total", "vllm:num_preemptions_total")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_samples(text: str) -> dict[str, list[float]]:
    """Metric name -> values of all its label sets, from Prometheus text format."""
    samples: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        samples.setdefault(match.group(1), []).append(value)
    return samples


def first_present(samples: dict[str, list[float]], names: tuple[str, ...]) -> list[float] | None:
    for name in names:
        if name in samples:
            return samples[name]
    return None


@dataclass
class MetricsSnapshot:
    kv_cache_usage: float | None  # peak over instances
    preemptions: float | None  # summed over instances


async def scrape(
    http: httpx.AsyncClient,
    base_url: str,
    on_refused: Callable[[int], None] | None = None,
) -> MetricsSnapshot | None:
    """One read of `/metrics`; None when the server has no such endpoint or refuses it
    (then `on_refused` hears the status: a wrong key must not pass for "no metrics")."""
    try:
        response = await http.get(f"{base_url.rstrip('/')}/metrics", timeout=5.0)
        if response.status_code in (401, 403) and on_refused is not None:
            on_refused(response.status_code)
        if response.status_code != 200:
            return None
    except httpx.HTTPError:
        return None
    samples = parse_samples(response.text)
    usage = first_present(samples, KV_USAGE_NAMES)
    preemptions = first_present(samples, PREEMPTION_NAMES)
    return MetricsSnapshot(
        kv_cache_usage=max(usage) if usage else None,
        preemptions=sum(preemptions) if preemptions else None,
    )


class MetricsWatcher:
    """Polls `/metrics` while a step runs; reports peak KV usage and new preemptions."""

    def __init__(self, base_url: str, interval_s: float = 0.5) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        # pdserve guards /metrics with its API keys (unless --metrics-public), vLLM
        # leaves it open but a proxy in front may guard it: send the key, and say so
        # loudly when it is refused rather than drop the scraped figures silently.
        self.http = httpx.AsyncClient(headers=auth_headers())
        self.refused = False
        self.peak_kv_usage: float | None = None
        self.start_preemptions: float | None = None
        self.end_preemptions: float | None = None
        self.task: asyncio.Task | None = None

    def record(self, snapshot: MetricsSnapshot | None) -> None:
        if snapshot is None:
            return
        if snapshot.kv_cache_usage is not None:
            self.peak_kv_usage = max(self.peak_kv_usage or -math.inf, snapshot.kv_cache_usage)
        if snapshot.preemptions is not None:
            if self.start_preemptions is None:
                self.start_preemptions = snapshot.preemptions
            self.end_preemptions = snapshot.preemptions

    def warn_refused(self, status: int) -> None:
        """Say once, loudly, that the server refused the scrape."""
        if self.refused:
            return
        self.refused = True
        hint = "set OPENAI_API_KEY to the server's key" if status == 401 else "check the key"
        print(
            f"pdserve bench: warning: {self.base_url}/metrics answered {status}; "
            f"KV-cache usage and preemptions will be missing ({hint})",
            file=sys.stderr,
        )

    async def read(self) -> MetricsSnapshot | None:
        return await scrape(self.http, self.base_url, self.warn_refused)

    async def start(self) -> None:
        self.record(await self.read())
        self.task = asyncio.create_task(self.poll())

    async def poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.record(await self.read())

    async def stop(self) -> dict:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.record(await self.read())
        await self.http.aclose()
        preemptions = None
        if self.start_preemptions is not None and self.end_preemptions is not None:
            preemptions = self.end_preemptions - self.start_preemptions
        return {"kv_cache_usage_perc": self.peak_kv_usage, "num_preemptions": preemptions}
