"""An in-process gateway with tenants and a make-believe colocated instance that answers
(or holds) every task, driven by httpx on the test's own event loop: no weights load
and no socket opens, so the tenant tests stay fast.

    async with tenant_gateway(TENANTS) as (gateway, instance, client):
        response = await client.post("/v1/completions", json=..., headers=key("a-key"))
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.common.messages import GenerateTask, InstanceAddress, InstanceInfo, RequestDelta
from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.gateway import Gateway, GatewayConfig
from pdserve.gateway.request_stream import StreamEvent
from pdserve.gateway.tenants import KeysFile, TenantEntry
from tests.gateway.in_process import app_client

MODELS = ["m", "m-large"]
ADMIN = "admin-secret-key"
INSTANCE = "colocated-0"


def key(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


def keys_file(*tenants: TenantEntry) -> KeysFile:
    return KeysFile(list(tenants))


@dataclass
class FakeInstance:
    """Stands in for the dispatcher's submit: records each task and finishes it with
    `tokens` generated tokens at once, or holds it until `finish_held`."""

    tokens: int = 1
    hold: bool = False
    tasks: list[GenerateTask] = field(default_factory=list)
    held: list[tuple[GenerateTask, Callable[[StreamEvent], None]]] = field(default_factory=list)

    def submit(self, task: GenerateTask, sink: Callable[[StreamEvent], None]) -> None:
        self.tasks.append(task)
        if self.hold:
            self.held.append((task, sink))
        else:
            asyncio.get_running_loop().call_soon(self._finish, task, sink)

    def finish_held(self) -> None:
        held, self.held = self.held, []
        for task, sink in held:
            self._finish(task, sink)

    def _finish(self, task: GenerateTask, sink: Callable[[StreamEvent], None]) -> None:
        delta = RequestDelta(task.request_id, [42] * self.tokens, 0, finish_reason="length")
        sink(StreamEvent(task.request_id, INSTANCE, delta, arrival=time.perf_counter()))


def make_gateway(clock: Callable[[], float] = time.monotonic, **config: Any) -> Gateway:
    gateway = Gateway(GatewayConfig(str(embedded_model_path()), MODELS, **config), clock)
    address = InstanceAddress(INSTANCE, "colocated", "tcp://127.0.0.1:1")
    gateway.register(InstanceInfo(address, "tcp://127.0.0.1:2", "m", 1024, 49152, 16, 64, 8))
    return gateway


@contextlib.asynccontextmanager
async def tenant_gateway(
    clock: Callable[[], float] = time.monotonic, **config: Any
) -> AsyncIterator[tuple[Gateway, FakeInstance, httpx.AsyncClient]]:
    gateway = make_gateway(clock, **config)
    instance = FakeInstance()
    gateway.dispatcher.submit = instance.submit  # type: ignore[method-assign]
    async with app_client(gateway) as client:
        yield gateway, instance, client


def completion(max_tokens: int = 4, **fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello there", "max_tokens": max_tokens, **fields}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
