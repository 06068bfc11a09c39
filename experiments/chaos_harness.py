"""The chaos suite's harness: a steady load of streaming requests, faults on instances,
and one row of counts per scenario (`experiments/chaos.py` has the scenarios).

A `Load` keeps a number of streams open (each a `Probe` read on a thread); a `Chaos`
runs one scenario on a server: the pools full, the fault-free texts known, the load
on, the fault injected (`kill`, `pause`, `fail_steps`), the pools awaited (`PoolWatch`), the load
drained, and then it counts: completed, failed (an error event or HTTP error), lost
(neither), wrong (text, or prompt and completion token counts, unlike the fault-free
run's), blocks held once idle (`/debug/instances`), and the counters of `/metrics`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from experiments.serving import MODEL, ServeProcess

MAX_TOKENS = 32
POOLS_FULL_LIMIT_S = 90.0  # how long a run waits for the pools (the target is 60 s)
SEEDED = {"temperature": 0.8, "seed": 4321}
GREEDY = {"temperature": 0}


@dataclass(frozen=True)
class Shape:
    """One kind of request of the load: its prompt and sampling."""

    name: str
    prompt: str | list[int]
    sampling: dict

    def body(self, stream: bool) -> dict:
        # A fresh cache salt per long request: no prefix-cache hit spares its prefill.
        salt = {"cache_salt": uuid.uuid4().hex} if isinstance(self.prompt, list) else {}
        usage = {"stream_options": {"include_usage": True}} if stream else {}
        return {"model": MODEL, "prompt": self.prompt, "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": stream, **self.sampling, **salt, **usage}  # fmt: skip


class Probe:
    """One streaming request, read on a thread: its text, finish and errors."""

    def __init__(self, server: ServeProcess, shape: Shape) -> None:
        self.shape = shape
        self.chunks: list[str] = []
        self.errors: list[str] = []
        self.finish_reason: str | None = None
        self.request_id: str | None = None  # from the first chunk
        self.usage: dict | None = None  # from the last
        self.done = False
        self.sent_at = time.monotonic()
        self._thread = threading.Thread(target=self._read, args=(server,), daemon=True)
        self._thread.start()

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def _read(self, server: ServeProcess) -> None:
        try:
            with (
                httpx.Client(base_url=server.base_url, headers=server.headers, timeout=240) as c,
                c.stream("POST", "/v1/completions", json=self.shape.body(True)) as response,
            ):
                if response.status_code != 200:
                    self.errors.append(f"HTTP {response.status_code}: {response.read()[:200]!r}")
                    return
                for line in response.iter_lines():
                    self._absorb(line)
        except httpx.HTTPError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.done = True

    def _absorb(self, line: str) -> None:
        if line.startswith('data: {"error"'):
            self.errors.append(line[6:])
        elif line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            if not chunk["choices"]:
                return
            choice = chunk["choices"][0]
            self.request_id = self.request_id or chunk["id"]
            self.chunks.append(choice["text"])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def join(self, timeout_s: float) -> None:
        self._thread.join(max(0.0, timeout_s))


class Load:
    """Keeps `concurrency` streams open, cycling through `shapes`, until stopped."""

    def __init__(self, server: ServeProcess, kinds: list[Shape], concurrency: int) -> None:
        self.server, self.kinds, self.concurrency = server, kinds, concurrency
        self.probes: list[Probe] = []
        self._stop = threading.Event()
        self._held = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            open_ = sum(not p.done for p in self.probes)
            if open_ < self.concurrency and not self._held.is_set():
                self.send(self.kinds[len(self.probes) % len(self.kinds)])
            else:
                self._stop.wait(0.02)

    def send(self, shape: Shape) -> Probe:
        probe = Probe(self.server, shape)
        self.probes.append(probe)
        return probe

    def hold(self) -> None:
        """Sends nothing new until `resume`."""
        self._held.set()

    def resume(self) -> None:
        self._held.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def join(self, timeout_s: float) -> None:
        """Waits for every stream to end (or the time to run out)."""
        deadline = time.monotonic() + timeout_s
        for probe in list(self.probes):
            probe.join(deadline - time.monotonic())


@dataclass
class Row:
    scenario: str
    sent: int = 0
    completed: int = 0
    migrated: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    wrong: int = 0
    leaked_blocks: int = 0
    pools_full_s: float | None = None  # None: not full again within the limit
    elapsed_s: float = 0.0  # the whole run, load and idle check included
    phases: dict[str, float] = field(default_factory=dict)  # seconds into the run
    counters: dict[str, float] = field(default_factory=dict)  # deltas of /metrics
    notes: list[str] = field(default_factory=list)


COUNTERS = {
    "migrated": "pdserve:requests_migrated_total",
    "retried": "pdserve:num_requests_retried_total",
    "restarted": "pdserve:num_instances_restarted_total",
    "rejoined": "pdserve:num_instances_rejoined_total",
    "fenced": "pdserve:num_instances_fenced_total",
    "recomputed": "pdserve:kv_transfer_recomputed_requests_total",
    "kv_failures": "pdserve:kv_transfer_failures_total",
    "lease_expiries": "pdserve:kv_transfer_lease_expiries_total",
}


def counters(server: ServeProcess) -> dict[str, float]:
    return read_counters(server.get("/metrics").text)


def read_counters(text: str) -> dict[str, float]:
    """The chaos-relevant counters of a /metrics text, summed over their labels."""
    found = {}
    for key, name in COUNTERS.items():
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        found[key] = sum(float(v) for v in values)
    return found


def health(server: ServeProcess) -> list[dict]:
    try:
        response = server.get("/health")
    except httpx.HTTPError:
        return []
    return response.json().get("instances", []) if response.status_code == 200 else []


def pools_full(server: ServeProcess, sizes: dict[str, int]) -> bool:
    live: dict[str, int] = {}
    for entry in health(server):
        if entry["alive"]:
            live[entry["role"]] = live.get(entry["role"], 0) + 1
    return all(live.get(role, 0) >= size for role, size in sizes.items())


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


class PoolWatch:
    """From a fault on: when a pool first fell short, and when all were full again."""

    def __init__(self, server: ServeProcess, sizes: dict[str, int], short_within_s: float):
        self.server, self.sizes, self.short_within_s = server, sizes, short_within_s
        self.started = time.monotonic()
        self.went_short = False
        self.full_after_s: float | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        limit = self.started + POOLS_FULL_LIMIT_S
        while time.monotonic() < limit:
            full = pools_full(self.server, self.sizes)
            now = time.monotonic()
            if not full:
                self.went_short = True
            elif self.went_short or now - self.started > self.short_within_s:
                self.full_after_s = now - self.started if self.went_short else 0.0
                return
            time.sleep(0.1)

    def wait(self) -> float | None:
        self._thread.join(POOLS_FULL_LIMIT_S + 5)
        return self.full_after_s


class Chaos:
    """One server under test: fault-free texts, faults, and one run per scenario."""

    def __init__(self, server: ServeProcess, sizes: dict[str, int]) -> None:
        self.server, self.sizes = server, sizes
        self.expected: dict[str, str] = {}  # shape name → the fault-free text
        self.expected_usage: dict[str, dict] = {}  # and its usage
        self.watch: PoolWatch | None = None
        self.short_within_s = 10.0
        self.notes: list[str] = []  # what an injection saw, for the row

    # ---- faults -----------------------------------------------------------------------

    def instances(self) -> dict[str, dict]:
        return self.server.instances()

    def kill(self, instance_id: str, pid: int | None = None) -> None:
        """SIGKILL to the instance's process (`pid`: known already; asking the gateway
        waits for every instance's step to end)."""
        pid = pid or self.instances()[instance_id]["pid"]
        self._watch()
        os.kill(pid, signal.SIGKILL)

    def pause(self, instance_id: str, seconds: float) -> None:
        """SIGSTOP for `seconds`, then SIGCONT (its heartbeats stop with it)."""
        pid = self.instances()[instance_id]["pid"]
        self._watch()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):  # fenced meanwhile: killed
                os.kill(pid, signal.SIGCONT)

    def fail_steps(
        self, instance_id: str, every_step: bool = False, prompt_prefix: list[int] | None = None
    ) -> None:
        """The test hook: the instance's steps fail (all of them, or while a request
        with this prompt prefix is there); no arguments: they stop failing."""
        body = {"every_step": every_step, "prompt_prefix": prompt_prefix or []}
        response = self.server.post(f"/debug/instances/{instance_id}/fail-steps", json=body)
        response.raise_for_status()

    def alive(self, instance_id: str) -> bool:
        return any(e["id"] == instance_id and e["alive"] for e in health(self.server))

    def _watch(self) -> None:
        if self.watch is None:
            self.watch = PoolWatch(self.server, self.sizes, self.short_within_s)

    def in_flight(self, instance_id: str) -> set[str]:
        """The requests the gateway's books say still need the instance."""
        return set(self.instances()[instance_id]["in_flight"])

    # ---- runs -------------------------------------------------------------------------

    def learn_expected(self, kinds: list[Shape]) -> None:
        """Each shape's fault-free text (a non-streaming request, pools full)."""
        for shape in kinds:
            if shape.name not in self.expected:
                response = self.server.post("/v1/completions", json=shape.body(False))
                response.raise_for_status()
                found = response.json()
                self.expected[shape.name] = found["choices"][0]["text"]
                self.expected_usage[shape.name] = found["usage"]

    def run(
        self,
        name: str,
        inject: Callable[[Chaos, Load], None],
        kinds: list[Shape],
        concurrency: int = 4,
        short_within_s: float = 10.0,
    ) -> Row:
        """The load on, the fault injected, the pools awaited, the load drained."""
        wait_for(lambda: pools_full(self.server, self.sizes), POOLS_FULL_LIMIT_S, "full pools")
        self.learn_expected(kinds)
        before = counters(self.server)
        self.watch, self.short_within_s, self.notes = None, short_within_s, []
        row = Row(name)
        started = time.monotonic()
        with Load(self.server, kinds, concurrency) as load:
            inject(self, load)  # it waits for the state its fault needs
            self._watch()
            assert self.watch is not None
            faulted = time.monotonic()
            row.pools_full_s = self.watch.wait()
            sent = len(load.probes)  # streams on the pools as they are again
            wait_for(lambda: sum(p.done for p in load.probes[sent:]) >= 2, 120,
                     "the load after the fault")  # fmt: skip
        load.join(240)
        drained = time.monotonic()
        self._score(row, load.probes)
        row.leaked_blocks = self._leaked_blocks(row)
        row.phases = {"fault": faulted - started, "drained": drained - started,
                      "idle": time.monotonic() - started}  # fmt: skip
        after = counters(self.server)
        row.counters = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        row.migrated = int(row.counters.get("migrated", 0))
        row.retried = int(row.counters.get("retried", 0))
        row.elapsed_s = time.monotonic() - started
        row.notes[:0] = self.notes
        return row

    def _score(self, row: Row, probes: list[Probe]) -> None:
        row.sent = len(probes)
        for probe in probes:
            if probe.errors:
                row.failed += 1
                row.notes.append(f"{probe.shape.name} failed: {probe.errors[0][:160]}")
            elif not probe.done or probe.finish_reason is None:
                row.lost += 1
            else:
                row.completed += 1
                usage = self.expected_usage[probe.shape.name]
                if counts(probe.usage) != counts(usage):  # a migration's output counts once
                    row.wrong += 1
                    row.notes.append(f"{probe.shape.name} usage {probe.usage}, expected {usage}")
                elif probe.text != self.expected[probe.shape.name]:
                    row.wrong += 1
                    row.notes.append(
                        f"{probe.shape.name} wrong: {probe.text!r}, "
                        f"expected {self.expected[probe.shape.name]!r}"
                    )

    def _leaked_blocks(self, row: Row) -> int:
        """Blocks neither free nor cached on a live instance once nothing runs."""
        leaked = 0
        for instance_id, found in self.server.wait_idle(timeout_s=60).items():
            inspection = found["inspection"]
            if not found["alive"]:
                continue
            if inspection is None:
                row.notes.append(f"{instance_id} did not answer its inspection")
                continue
            leaked += inspection["num_total_blocks"] - inspection["num_free_blocks"]
            for key in ("unfinished_request_ids", "invariant_error"):
                if inspection[key]:
                    row.notes.append(f"{instance_id} {key}: {inspection[key]}")
        return leaked


def counts(usage: dict | None) -> tuple[int, int] | None:
    """Prompt and completion tokens (cached tokens differ from run to run)."""
    return None if usage is None else (usage["prompt_tokens"], usage["completion_tokens"])
