from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.kvtransfer.peer import Peer

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


@pytest.fixture(scope="module")
def peer_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Peer]]:
    """Spawns child processes; every one is shut down (killed by PID if need be)."""
    log_dir = tmp_path_factory.mktemp("peers")
    peers: list[Peer] = []

    def spawn(name: str, env: dict[str, str] | None = None) -> Peer:
        peer = Peer(name, env or {}, log_dir)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.shutdown()


@pytest.fixture
def fresh_peers(tmp_path: Path) -> Iterator[Callable[..., Peer]]:
    """Like peer_factory, for tests that kill their processes: cleaned up per test."""
    peers: list[Peer] = []

    def spawn(name: str, env: dict[str, str] | None = None) -> Peer:
        peer = Peer(name, env or {}, tmp_path)
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.shutdown()
