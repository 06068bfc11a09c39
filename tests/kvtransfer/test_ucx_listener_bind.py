"""The "ucx-listener" transport's listener as the kernel has it bound (/proc/net/tcp):
every interface, whatever host the instance has. docs/security.md says so and names the
operator's network-policy step; this keeps that page true (a ucxx that binds the host
fails here, and the page changes with it)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pdserve.kvtransfer.transport import make_transport

_LISTEN = "0A"


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_on(port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of every TCP socket listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_address, hex_port = local.split(":")
            if state == _LISTEN and int(hex_port, 16) == port:
                found.append(_address(hex_address))
    return found


def test_the_parser_reads_the_kernels_byte_order() -> None:
    assert str(_address("0100007F")) == "127.0.0.1"
    assert str(_address("00000000000000000000000000000000")) == "::"


def test_the_ucx_listener_binds_every_interface_not_only_its_host() -> None:
    transport = make_transport("ucx-listener", "127.0.0.1", "tcp,self", None)
    try:
        port = int(transport.info.decode().rsplit(":", 1)[1])
        bound = listening_on(port)
        assert bound, f"nothing listens on {port}"
        assert all(address.is_unspecified for address in bound), bound
    finally:
        transport.close()
