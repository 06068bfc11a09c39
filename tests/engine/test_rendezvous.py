"""A worker group's rendezvous store holds its port from the moment the driver makes it:
no window in which another socket can take the port before rank 0 binds it."""

from __future__ import annotations

import socket

import pytest

from pdserve.engine.pipeline import Rendezvous


def test_the_rendezvous_holds_its_port_from_the_start() -> None:
    rendezvous = Rendezvous("127.0.0.1", timeout_s=5.0)
    host, port = rendezvous.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", int(port)))
