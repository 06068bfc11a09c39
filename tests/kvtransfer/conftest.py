from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.kvtransfer.peer import Peer

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


@contextmanager
def _spawner(log_dir: Path) -> Iterator[Callable[..., Peer]]:
    """A function that spawns child processes logging into `log_dir`; on exit every one
    is shut down (killed by PID if need be)."""
    peers: list[Peer] = []

    def spawn(name: str, env: dict[str, str] | None = None) -> Peer:
        peer = Peer(name, env or {}, log_dir)
        peers.append(peer)
        return peer

    try:
        yield spawn
    finally:
        for peer in peers:
            peer.shutdown()


@pytest.fixture(scope="module")
def peer_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Peer]]:
    """Spawns child processes, shut down after the module's tests."""
    with _spawner(tmp_path_factory.mktemp("peers")) as spawn:
        yield spawn


@pytest.fixture
def fresh_peers(tmp_path: Path) -> Iterator[Callable[..., Peer]]:
    """Like peer_factory, for tests that kill their processes: cleaned up per test."""
    with _spawner(tmp_path) as spawn:
        yield spawn
