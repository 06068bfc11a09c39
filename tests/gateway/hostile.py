"""A gateway with one make-believe colocated instance, for hostile-input tests: no weights
load, so each test module builds its own in a fraction of a second. `TestClient` for what
the app answers; `Serving` for what needs a real HTTP server (a uvicorn thread on
127.0.0.1): timing /health, and bodies sent slowly or without an end."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.testclient import TestClient

from pdserve.cluster.http_server import GuardedH11Protocol, uvicorn_config
from pdserve.common.messages import InstanceAddress, InstanceInfo
from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.app import create_app
from pdserve.gateway.gateway import Gateway, GatewayConfig

MAX_MODEL_LEN = 1024
VOCAB_SIZE = 49152
HEAD_TIMEOUT_S = 1.0


def make_gateway(**config: Any) -> Gateway:
    gateway = Gateway(GatewayConfig(str(embedded_model_path()), ["m"], **config))
    address = InstanceAddress("colocated-0", "colocated", "tcp://127.0.0.1:1")
    gateway.register(
        InstanceInfo(address, "tcp://127.0.0.1:2", "m", MAX_MODEL_LEN, VOCAB_SIZE, 16, 64, 8)
    )
    return gateway


def client_of(gateway: Gateway) -> TestClient:
    return TestClient(create_app(gateway), raise_server_exceptions=False)


def close(gateway: Gateway) -> None:
    asyncio.run(gateway.close())


@dataclass
class Serving:
    """The gateway's app behind a real uvicorn, in a thread of this process."""

    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @classmethod
    def start(cls, gateway: Gateway) -> Serving:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(2048)
        # pdserve serve's settings, with a head timeout short enough for a test.
        protocol = type("Guarded", (GuardedH11Protocol,), {"head_timeout_s": HEAD_TIMEOUT_S})
        server = uvicorn.Server(uvicorn_config(create_app(gateway), http=protocol))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return cls(server, thread, "127.0.0.1", sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
