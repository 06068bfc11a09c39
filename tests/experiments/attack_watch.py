"""An attack on a running server under load, and what is watched meanwhile: `/health` on
a thread, the frames each channel dropped (`pdserve:dropped_frames_total`), each
instance's life, and every request's greedy text against the one it had before."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from experiments import attack_ports, attacks
from experiments.chaos_harness import Load, Probe, Shape, counters, wait_for
from experiments.serving import ServeProcess

DROPS_LINE = re.compile(
    r'^pdserve:dropped_frames_total\{channel="([^"]+)",reason="([^"]+)"\} (\S+)$', re.M
)
HEALTH_LIMIT_S = 1.0


def drops_by_reason(server: ServeProcess) -> dict[tuple[str, str], float]:
    """`pdserve:dropped_frames_total` by (channel, reason)."""
    text = server.get("/metrics").text
    return {(channel, reason): float(n) for channel, reason, n in DROPS_LINE.findall(text)}


def drops(server: ServeProcess) -> dict[str, float]:
    """`pdserve:dropped_frames_total` by channel (summed over reasons)."""
    found: dict[str, float] = {}
    for (channel, _), value in drops_by_reason(server).items():
        found[channel] = found.get(channel, 0.0) + value
    return found


def oversized(server: ServeProcess) -> dict[str, float]:
    """The `oversized` drops by channel."""
    return {c: n for (c, reason), n in drops_by_reason(server).items() if reason == "oversized"}


def grown(
    server: ServeProcess,
    before: dict[str, float],
    channels: set[str],
    read: Callable[[ServeProcess], dict[str, float]] = drops,
) -> set[str]:
    """The channels whose drops (as `read` counts them) grew, once all of `channels` did
    (or 20 s passed)."""
    deadline = time.monotonic() + 20
    while True:
        now = read(server)
        up = {c for c, n in now.items() if n > before.get(c, 0.0)}
        if channels <= up or time.monotonic() > deadline:
            return up
        time.sleep(0.3)


class HealthPoller:
    """Asks `/health` every 0.2 s on a thread: the slowest answer, and any that failed."""

    def __init__(self, server: ServeProcess) -> None:
        self.slowest_s = 0.0
        self.failures: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(server,), daemon=True)
        self._thread.start()

    def _poll(self, server: ServeProcess) -> None:
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=10) as c:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    status = c.get("/health").status_code
                except httpx.HTTPError as exc:
                    status, error = 0, f"{type(exc).__name__}: {exc}"
                else:
                    error = f"HTTP {status}"
                self.slowest_s = max(self.slowest_s, time.monotonic() - began)
                self.polls += 1
                if status != 200:
                    self.failures.append(error)
                self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def text_of(server: ServeProcess) -> Callable[[Shape], str]:
    def text(shape: Shape) -> str:
        response = server.post("/v1/completions", json=shape.body(False))
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    return text


def instances(server: ServeProcess) -> dict[str, tuple[int, int, bool]]:
    """Each instance's (pid, epoch, alive)."""
    return {i: (v["pid"], v["epoch"], v["alive"]) for i, v in server.instances().items()}


@dataclass
class Attacked:
    """What an attack under load sent, and what the server did meanwhile."""

    outcomes: list[attacks.Outcome]
    captured: int  # messages a stranger's SUB read
    probes: list[Probe]
    expected: dict[str, str]  # each shape's text before the attack
    slowest_health_s: float
    health_failures: list[str]
    health_polls: int
    attack_s: float

    def report(self) -> str:
        return "\n".join(
            f"{o.port.endpoint} {o.kind} {o.port.owner}: {o.sent} {o.notes}" for o in self.outcomes
        )


def attack_under_load(
    server: ServeProcess, ports: list[attack_ports.Port], shapes: list[Shape], concurrency: int = 3
) -> Attacked:
    """Every port in `ports` attacked while `concurrency` streams run, until a stream
    sent after the attack ended and every stream did."""
    with ThreadPoolExecutor(len(shapes)) as pool:  # each shape's text, attacks aside
        texts = pool.map(text_of(server), shapes)
        expected = dict(zip([s.name for s in shapes], texts, strict=True))
    poller = HealthPoller(server)
    attacker = attacks.Attacker()
    try:
        with Load(server, shapes, concurrency) as load:
            wait_for(lambda: any(p.chunks for p in load.probes), 60, "streams under way")
            began = time.monotonic()
            try:
                outcomes = attacker.attack(ports)
            finally:
                attacker.close()
            attack_s = time.monotonic() - began
            sent = len(load.probes)
            wait_for(lambda: any(p.done for p in load.probes[sent:]), 90,
                     "a stream sent after the attack")  # fmt: skip
        load.join(120)
    finally:
        poller.stop()
    return Attacked(
        outcomes, len(attacker.captured), list(load.probes), expected,
        poller.slowest_s, poller.failures, poller.polls, attack_s,
    )  # fmt: skip


def assert_unharmed(
    server: ServeProcess,
    attacked: Attacked,
    lives_before: dict[str, tuple[int, int, bool]],
    counters_before: dict[str, float],
) -> None:
    """No request failed or changed its text, no instance was restarted, fenced or
    given a new epoch, and `/health` kept answering within `HEALTH_LIMIT_S`."""
    probes = attacked.probes
    assert probes and all(p.done and not p.errors for p in probes), [p.errors for p in probes]
    wrong = [(p.shape.name, p.text) for p in probes if p.text != attacked.expected[p.shape.name]]
    assert not wrong and all(p.finish_reason for p in probes), wrong
    assert instances(server) == lives_before
    assert all(alive for _, _, alive in lives_before.values())
    after = counters(server)
    for name in ("restarted", "fenced", "rejoined"):
        assert after[name] == counters_before[name], (name, after)
    slowest, failures = attacked.slowest_health_s, attacked.health_failures
    assert not failures and slowest < HEALTH_LIMIT_S, (slowest, failures[:3])
    assert attacked.health_polls > 10
