"""The attack suite: every listening TCP port of a deployment, attacked as a stranger on
its node would.

    python -m experiments.attacks --base-url http://127.0.0.1:PORT [--ray-address GCS]

The ports are found as a stranger would (`attack_ports.py`: the deployment's processes
through /proc, what each port is from what it answers).

What each port gets (`Attacker.attack`), a few frames per port:

- ZMQ PUB (block events): a SUB that captures what it can (a stranger can read this
  channel: frames are authenticated, not encrypted); what it captured is replayed
  elsewhere, since the only receiver of its channel (the gateway's SUB) listens on no
  port;
- ZMQ PULL (tasks, outputs, the `zmq` KV transport's data) and ROUTER (a worker
  group's ranks, KV control): junk single frames, a 3-part and an empty message, the
  captured messages replayed as they were and a captured pair in reverse order, and for
  each channel such a socket may receive, a message one byte past that channel's limit
  (`frame_seal.Channel.max_frame_bytes`, read from the code: `RECEIVERS`), smallest
  first (a channel with a smaller limit refuses a larger frame in ZMQ, which disconnects
  the sender); to a ROUTER through DEALERs named like ranks ("0", "1", "2", "driver")
  and like no rank ("99"); nothing sent to a PULL or a ROUTER comes back, so neither
  channel can be captured from outside;
- raw TCP and HTTP: garbage bytes, a ZMTP greeting cut short, and a burst of random
  bytes; the admin API is asked without a key and with a tenant's key (`probe_admin`).

Nothing here checks the outcome: the caller (`tests/cluster/test_attacks.py`) compares
the deployment before and after (requests, restarts, `/health`, and
`pdserve:dropped_frames_total` per channel).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import zmq

from experiments.attack_ports import (
    PROBE_TIMEOUT_S,
    ZMTP_SIGNATURE,
    Port,
    deployment_ports,
    identify_all,
)
from pdserve.common.frame_seal import (
    KV_CONTROL,
    MAX_HEADER_BYTES,
    OUTPUTS,
    RANKS,
    TASKS,
    Channel,
)
from pdserve.kvtransfer.zmq_transport import CHUNK_HEADER, KV_DATA

# The channels a stranger may reach through each kind of socket, by the socket type
# its peer sees: each gets a message one byte past its limit.
RECEIVERS: dict[str, tuple[Channel, ...]] = {
    "zmq PULL": (TASKS, OUTPUTS, KV_DATA),
    "zmq ROUTER": (RANKS, KV_CONTROL),
}
RANK_NAMES = (b"0", b"1", b"2", b"driver", b"99")
LINGER_MS = 3000  # long enough for a 64 MiB frame to leave on a loaded machine
CAPTURE_S = 15.0  # how long the SUBs listen for frames to replay, at most


@dataclass
class Outcome:
    """What one port was found to be, and what was sent to it."""

    port: Port
    kind: str = "tcp"  # "zmq PULL", "zmq ROUTER", "zmq PUB", ..., "http" or "tcp"
    sent: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---- the attacks -----------------------------------------------------------------------


class Attacker:
    """Attacks each port once: captures first (PUB ports), then the rest with replays."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.captured: list[list[bytes]] = []  # whole multipart messages, as received

    def attack(self, ports: list[Port]) -> list[Outcome]:
        outcomes = [Outcome(p, kind) for p, kind in zip(ports, identify_all(ports), strict=True)]
        subscribers = [(o, self._subscribe(o)) for o in outcomes if o.kind == "zmq PUB"]
        raw = [o for o in outcomes if not o.kind.startswith("zmq")]
        with ThreadPoolExecutor(max_workers=16) as pool:  # listening meanwhile
            list(pool.map(self._send_garbage, raw))
        self._capture(subscribers)
        for outcome in outcomes:
            if outcome.kind in ("zmq PULL", "zmq ROUTER"):
                self._send_frames(outcome)
            elif outcome.kind.startswith("zmq") and outcome.kind != "zmq PUB":
                outcome.notes.append("no attack written for this socket type")
        return outcomes

    def close(self) -> None:
        """Once every frame queued left (each socket lingers at most `LINGER_MS`)."""
        self.context.term()

    def _socket(self, kind: int, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.IPV6, 1)  # a listener on :: or ::1 too
        sock.setsockopt(zmq.SNDTIMEO, int(PROBE_TIMEOUT_S * 1000))
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(endpoint)
        return sock

    def _subscribe(self, outcome: Outcome) -> zmq.Socket:
        sub = self._socket(zmq.SUB, outcome.port.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        outcome.sent.append("subscribe")
        return sub

    def _capture(self, subscribers: list[tuple[Outcome, zmq.Socket]]) -> None:
        """What the SUBs read, until two messages came (or `CAPTURE_S` passed)."""
        poller = zmq.Poller()
        for _, sub in subscribers:
            poller.register(sub, zmq.POLLIN)
        got = dict.fromkeys(range(len(subscribers)), 0)
        deadline = time.monotonic() + CAPTURE_S
        while subscribers and len(self.captured) < 2 and time.monotonic() < deadline:
            ready = dict(poller.poll(100))
            for i, (_, sub) in enumerate(subscribers):
                if sub in ready:
                    self.captured.append(sub.recv_multipart())
                    got[i] += 1
        for i, (outcome, sub) in enumerate(subscribers):
            sub.close(linger=0)
            outcome.notes.append(f"captured {got[i]} messages")

    def _send_frames(self, outcome: Outcome) -> None:
        endpoint = outcome.port.endpoint
        router = outcome.kind == "zmq ROUTER"
        senders = (
            [self._socket(zmq.DEALER, endpoint, name) for name in RANK_NAMES]
            if router
            else [self._socket(zmq.PUSH, endpoint)]
        )
        time.sleep(0.2)  # connected before the first frame
        first = senders[-1]  # a ROUTER's: named like no rank ("99")
        try:
            for sender in senders:
                self._send(sender, outcome, "junk frame", [os.urandom(48)])
            self._send(first, outcome, "3-part message", [b"part"] * 3)
            self._send(first, outcome, "empty message", [b""])
            for message in self.captured:
                self._send(first, outcome, "captured message replayed", message)
            if len(self.captured) >= 2:
                pair = self.captured[:2]
                for message in reversed(pair):
                    self._send(first, outcome, "captured pair reordered", message)
            for what, message in oversized_messages(RECEIVERS[outcome.kind]).items():
                self._send(first, outcome, what, message)
        finally:
            for sender in senders:
                sender.close()  # lingers: what was queued leaves first
        if not self.captured:
            outcome.notes.append("nothing captured to replay")

    @staticmethod
    def _send(sender: zmq.Socket, outcome: Outcome, what: str, parts: list[bytes]) -> None:
        try:
            sender.send_multipart(parts)
        except zmq.ZMQError as exc:  # a peer that refuses our name: ZMQ drops us
            outcome.notes.append(f"{what}: {exc}")
            return
        outcome.sent.append(what)

    @staticmethod
    def _send_garbage(outcome: Outcome) -> None:
        payloads = {
            "garbage line": b"GARBAGE \x00\xff\r\n\r\n" * 4,
            "cut ZMTP greeting": ZMTP_SIGNATURE + b"\x03",
            "random bytes": os.urandom(64 << 10),
        }
        for what, payload in payloads.items():
            try:
                with socket.create_connection(
                    (outcome.port.host, outcome.port.port), timeout=PROBE_TIMEOUT_S
                ) as s:
                    s.sendall(payload)
                    time.sleep(0.05)
            except OSError as exc:
                outcome.notes.append(f"{what}: {exc}")
                continue
            outcome.sent.append(what)


def oversized_message(channel: Channel) -> list[bytes]:
    """A message one byte past `channel`'s limit, in the shape its receiver takes, so
    that its size is what the receiver refuses: one frame (the seal's header and the
    payload), or for KV data a seal, a chunk's header and its bytes."""
    if channel is KV_DATA:
        header = bytes(CHUNK_HEADER.size)
        return [bytes(MAX_HEADER_BYTES), header, bytes(channel.max_frame_bytes + 1 - len(header))]
    return [bytes(channel.max_frame_bytes + MAX_HEADER_BYTES + 1)]


def oversized_messages(channels: tuple[Channel, ...]) -> dict[str, list[bytes]]:
    """What's past each channel's limit, smallest first; one message for channels whose
    messages would be alike (the tasks' and the outputs')."""
    found: dict[tuple[int, ...], tuple[list[str], list[bytes]]] = {}
    for channel in sorted(channels, key=lambda c: c.max_frame_bytes):
        message = oversized_message(channel)
        names, _ = found.setdefault(tuple(len(part) for part in message), ([], message))
        names.append(channel.name)
    return {f"{'/'.join(names)} limit + 1 byte": message for names, message in found.values()}


def probe_admin(base_url: str, tenant_key: str | None) -> dict[str, int]:
    """The operator routes without a key (and with a tenant's): each route's status."""
    routes = [
        ("POST", "/admin/pools/decode/scale", {"size": 4}),
        ("POST", "/admin/instances/decode-0/drain", None),
        ("POST", "/admin/instances/prefill-0/role", {"role": "decode"}),
        ("GET", "/debug/instances", None),
    ]
    found = {}
    for method, path, body in routes:
        for who, headers in (("none", {}), ("tenant", _bearer(tenant_key))):
            if who == "tenant" and tenant_key is None:
                continue
            response = httpx.request(
                method, base_url + path, json=body, headers=headers, timeout=10
            )
            found[f"{method} {path} ({who} key)"] = response.status_code
    return found


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.attacks", description=__doc__)
    parser.add_argument("--base-url", required=True, help="the gateway, http://HOST:PORT")
    parser.add_argument("--ray-address", help="only actors of this Ray cluster (its GCS)")
    parser.add_argument("--api-key", help="a tenant's key, to ask the admin API with")
    args = parser.parse_args()
    try:
        ports = deployment_ports(args.base_url, args.ray_address)
    except LookupError as exc:
        parser.exit(2, f"python -m experiments.attacks: error: {exc}\n")
    attacker = Attacker()
    try:
        outcomes = attacker.attack(ports)
    finally:
        attacker.close()
    for o in outcomes:
        print(f"{o.port.endpoint:28} {o.kind:11} pid {o.port.pid} {o.port.owner[:40]}")
        print(f"    sent: {', '.join(o.sent) or '-'}; {'; '.join(o.notes)}")
    for route, status in probe_admin(args.base_url, args.api_key).items():
        print(f"{route}: {status}")


if __name__ == "__main__":
    main()
