"""A worker group's rendezvous (engine/rendezvous.py): the store holds its port from the
moment the driver makes it, listens on the group's interface only, and keeps every key
the group uses behind a prefix only holders of the deployment secret can name; a rank
with another secret fails before it joins, naming the secret."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pdserve.common.wire_auth import SECRET_ENV, SecretError
from pdserve.engine.config import EngineConfig
from pdserve.engine.ranks import RankJob
from pdserve.engine.rendezvous import (
    Rendezvous,
    StoreValueForged,
    bind_collectives,
    interface_of,
    join_store,
)
from pdserve.engine.worker_group import _FAILED, run_rank


def outside_address() -> str | None:
    """An address of this machine that is not loopback (None when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet leaves: only a route is picked
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_the_rendezvous_holds_its_port_from_the_start_on_its_interface_only() -> None:
    rendezvous = Rendezvous("127.0.0.1", timeout_s=5.0)
    host, port = rendezvous.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", int(port)))
    outside = outside_address()
    if outside is not None:  # the same port on the node's address: nobody listens
        with socket.socket() as stranger, pytest.raises(ConnectionRefusedError):
            stranger.settimeout(2)
            stranger.connect((outside, int(port)))


def test_a_peer_without_the_secret_names_no_key_of_the_group() -> None:
    rendezvous = Rendezvous("127.0.0.1", timeout_s=5.0)
    rank = join_store(rendezvous.address, timeout_s=5.0)
    rank.set("gloo/rank0", b"10.0.0.1:4242")
    host, port = rendezvous.address.rsplit(":", 1)
    stranger = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
    assert not stranger.check(["gloo/rank0"])  # the key a peer without the prefix would ask
    stranger.set("gloo/rank0", b"the stranger's address")  # planted beside, never read
    assert rank.get("gloo/rank0") == b"10.0.0.1:4242"
    other = join_store(rendezvous.address, timeout_s=5.0)  # another rank: same prefix
    assert other.get("gloo/rank0") == b"10.0.0.1:4242"


def test_collectives_bind_the_interface_of_the_groups_address(monkeypatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the operator's choice stays
    loopback = interface_of("127.0.0.1")
    assert bind_collectives("127.0.0.1") == loopback

    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    with pytest.raises(OSError, match="no network interface holds"):
        interface_of("192.0.2.77")


def test_a_rank_with_another_secret_fails_at_once_naming_the_secret(monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "the driver's secret")
    rendezvous = Rendezvous("127.0.0.1", timeout_s=5.0)
    join_store(rendezvous.address, timeout_s=5.0)  # the driver's secret: it joins
    monkeypatch.setenv(SECRET_ENV, "another secret")
    started = time.monotonic()
    with pytest.raises(SecretError, match=f"deployment secret \\({SECRET_ENV}"):
        join_store(rendezvous.address, timeout_s=5.0)
    assert time.monotonic() - started < 1.0  # not the rendezvous timeout


def test_a_stranger_who_overwrites_a_proof_makes_no_rank_fail(monkeypatch) -> None:
    """The proof sits behind the group's prefix: where a stranger can write (the names
    it can make up), nothing a rank checks changes."""
    monkeypatch.setenv(SECRET_ENV, "the driver's secret")
    rendezvous = Rendezvous("127.0.0.1", timeout_s=5.0)
    host, port = rendezvous.address.rsplit(":", 1)
    stranger = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
    for name in ("pdserve/secret-proof", "secret-proof", "pdserve/rendezvous-proof"):
        stranger.set(name, b"not the driver's proof")
    join_store(rendezvous.address, timeout_s=5.0)  # the driver's secret: it joins


def test_a_stranger_who_lists_the_keys_plants_no_value_a_rank_reads() -> None:
    """torch's TCPStore answers `list_keys` to any client (docs/security.md, "Not
    protected", says so and changes when this fails): a stranger finds the group's keys
    and reads their values, but a value it writes fails its seal where a rank reads it."""
    rendezvous = Rendezvous("127.0.0.1", timeout_s=5.0)
    rank = join_store(rendezvous.address, timeout_s=5.0)
    rank.set("gloo/rank0", b"10.0.0.1:4242")
    host, port = rendezvous.address.rsplit(":", 1)
    stranger = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
    [gloo_key] = [k for k in stranger.list_keys() if k.endswith("gloo/rank0")]
    assert stranger.get(gloo_key).endswith(b"10.0.0.1:4242")
    sealed_elsewhere = stranger.get([k for k in stranger.list_keys() if k != gloo_key][0])
    for planted in (b"the stranger's address", sealed_elsewhere):  # new, or another key's
        stranger.set(gloo_key, planted)
        with pytest.raises(StoreValueForged, match="'gloo/rank0' .* fails its seal"):
            rank.get("gloo/rank0")


def test_gloo_joins_through_the_sealed_store(monkeypatch) -> None:
    """gloo exchanges its addresses through the sealed store (set, get, wait), and a
    collective runs over what it read."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface_of("127.0.0.1"))
    rendezvous = Rendezvous("127.0.0.1", timeout_s=20.0)
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        sums = pool.starmap(_all_reduce, [(rendezvous.address, rank) for rank in (0, 1)])
    assert sums == [3.0, 3.0]


def _all_reduce(master: str, rank: int) -> float:
    dist.init_process_group(
        "gloo", store=join_store(master, 20.0), rank=rank, world_size=2,
        timeout=timedelta(seconds=20),
    )  # fmt: skip
    try:
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        return float(total.item())
    finally:
        dist.destroy_process_group()


class Channel:
    """A rank's end of its channel to the driver, recording what the rank sends."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    def recv_bytes(self) -> bytes:
        raise EOFError


def test_a_rank_with_another_secret_tells_its_driver_why_before_it_joins(monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface_of("127.0.0.1"))
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", interface_of("127.0.0.1"))
    monkeypatch.setenv(SECRET_ENV, "the driver's secret")
    rendezvous = Rendezvous("127.0.0.1", timeout_s=5.0)
    monkeypatch.setenv(SECRET_ENV, "another secret")
    # Were the secret not checked, the join would fail at this timeout instead.
    monkeypatch.setattr("pdserve.engine.worker_group.GROUP_TIMEOUT_S", 3.0)
    channel = Channel()
    run_rank(RankJob(EngineConfig(), rank=1, size=2, master=rendezvous.address), channel)
    (reply,) = channel.sent
    assert reply[:1] == _FAILED
    message = reply[1:].decode()
    assert message.startswith("SecretError: the deployment secret") and "\n" not in message
