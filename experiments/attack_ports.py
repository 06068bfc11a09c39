"""A deployment's listening ports as a stranger on its node finds them, and what each is.

Finding them (Linux `/proc`, no help from the deployment): the gateway is the process
that holds the HTTP port's listening socket; its process tree, and the Ray workers
whose title names pdserve's actors (`ray::Instance`, `ray::ColocatedInstance`,
`ray::TensorParallelRank`; with a Ray address, only those under the raylet of that
cluster), are the deployment. Each socket descriptor of theirs is matched by inode to
the listening sockets of `/proc/net/tcp` and `/proc/net/tcp6`.

What each is: a ZMTP greeting says whether ZMQ speaks there and, in the peer's READY,
its socket type; an HTTP status line says HTTP; anything else is raw TCP (the worker
group's rendezvous store, gloo's and UCX's listeners, Ray's own gRPC servers).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

ACTOR_TITLE = re.compile(rb"^ray::(Instance|ColocatedInstance|TensorParallelRank)\b")
LISTEN = "0A"  # /proc/net/tcp's state column
ZMTP_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
ZMTP_GREETING = ZMTP_SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Port:
    """One listening socket of the deployment."""

    pid: int
    owner: str  # the process's title (the gateway's command, or the actor's)
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


# ---- finding the ports -----------------------------------------------------------------


def listening_sockets() -> dict[int, tuple[str, int]]:
    """inode → (address, port) of every listening TCP socket of this network namespace."""
    found = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != LISTEN:
                continue
            address, port = cols[1].split(":")
            found[int(cols[9])] = (_address(address), int(port, 16))
    return found


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if ip.is_unspecified:  # bound on every interface: reach it on loopback
        return "127.0.0.1" if ip.version == 4 else "::1"
    return str(ip)


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes  # gone, or another user's
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _pids() -> Iterator[int]:
    yield from (int(name) for name in os.listdir("/proc") if name.isdigit())


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def process_tree(root: int) -> list[int]:
    parents = {pid: _parent(pid) for pid in _pids()}
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def ray_actor_pids(ray_address: str | None) -> list[int]:
    """pdserve's actor processes; with `ray_address`, only under that cluster's raylet
    (its command line names the GCS address)."""
    found = []
    for pid in _pids():
        if not ACTOR_TITLE.match(_cmdline(pid)):
            continue
        if ray_address is None or _under_cluster(pid, ray_address.encode()):
            found.append(pid)
    return found


def _under_cluster(pid: int, gcs_address: bytes) -> bool:
    ancestor = _parent(pid)
    while ancestor > 1:
        if gcs_address in _cmdline(ancestor):
            return True
        ancestor = _parent(ancestor)
    return False


def holder_of(inode: int) -> int:
    """The process holding a socket (the gateway: its HTTP port's listener)."""
    for pid in _pids():
        if inode in socket_inodes(pid):
            return pid
    raise LookupError(f"no process of this user holds socket {inode}")


def deployment_ports(base_url: str, ray_address: str | None = None) -> list[Port]:
    """Every listening port of the gateway's process tree and of pdserve's actors."""
    listening = listening_sockets()
    http_port = urlsplit(base_url).port
    inodes = [i for i, (_, port) in listening.items() if port == http_port]
    if not inodes:
        raise LookupError(f"nothing listens on port {http_port} here")
    gateway = holder_of(inodes[0])
    ports = []
    for pid in sorted(set(process_tree(gateway) + ray_actor_pids(ray_address))):
        title = _cmdline(pid).split(b"\0")[0].decode(errors="replace")
        for inode in sorted(socket_inodes(pid)):
            if inode in listening:
                host, port = listening[inode]
                ports.append(Port(pid, title, host, port))
    return ports


# ---- what a port is --------------------------------------------------------------------


def identify(port: Port) -> str:
    """The port's kind: "zmq TYPE" (from the peer's READY), "http", or "tcp"."""
    try:
        with socket.create_connection((port.host, port.port), timeout=PROBE_TIMEOUT_S) as s:
            s.sendall(ZMTP_GREETING)
            reply = _read_exact(s, len(ZMTP_GREETING))
            if reply[:1] == b"\xff" and reply[9:10] == b"\x7f":
                head = _read_exact(s, 2)  # a short command frame: flags, size
                kind = _socket_type(_read_exact(s, head[1])) if len(head) == 2 else ""
                return f"zmq {kind}" if kind else "zmq"
            if reply.startswith(b"HTTP/"):
                return "http"
        with socket.create_connection((port.host, port.port), timeout=PROBE_TIMEOUT_S) as s:
            s.sendall(b"HEAD / HTTP/1.0\r\n\r\n")  # a server that waits for a line
            if _read_exact(s, 5) == b"HTTP/":
                return "http"
    except OSError:
        pass
    return "tcp"


def identify_all(ports: list[Port]) -> list[str]:
    """Every port's kind, probed side by side (a silent port takes the probe's timeout)."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(identify, ports))


def _read_exact(s: socket.socket, size: int) -> bytes:
    """`size` bytes, or what came before the peer closed or the probe's time ran out."""
    data = b""
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while len(data) < size and time.monotonic() < deadline:
        try:
            chunk = s.recv(size - len(data))
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _socket_type(command: bytes) -> str:
    """The Socket-Type property of a ZMTP READY command's body."""
    marker = command.find(b"Socket-Type")
    if marker < 0:
        return ""
    start = marker + len(b"Socket-Type")
    length = int.from_bytes(command[start : start + 4], "big")
    return command[start + 4 : start + 4 + length].decode(errors="replace")
