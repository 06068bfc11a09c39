"""The chaos suite: faults injected under a steady load of streaming requests.

    python -m experiments.chaos [--scenarios NAME,...] [--skip-node-loss]

Per scenario a steady load of streaming completions runs on the embedded model (greedy
streams, plus one seeded stream at temperature 0.8 in every round of the load) while
the fault is injected; then the load stops, every stream is awaited and the server
must go idle. The table says, per scenario: requests sent, completed, migrated
(`pdserve:requests_migrated_total`) and retried before their first token, failed with
an error event (or an HTTP error), lost (neither complete nor failed: must be 0), wrong
(a completed text unlike the fault-free run's: must be 0), KV blocks still held on
some instance once idle (must be 0), and the seconds from the fault until every pool
is back to its size (`/health`; 0 when no instance left its pool).

The single-node scenarios share one `pdserve serve` (local launcher, 2 prefill + 2
decode, test hooks on, pulls delayed by `PDSERVE_TEST_KV_DELAY_S` so that requests
visibly wait for remote KV). Node loss runs on the two-node Ray setup of
`tests/cluster/two_nodes.py` (needs root for `ip netns`). `tests/cluster/test_chaos.py`
asserts on the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from tests.cluster.serving import LOCAL, MODEL, served
from tests.gateway.server import ServeProcess

MAX_TOKENS = 32
KV_DELAY_S = 1.0  # every pull waits this long: requests sit in WAITING_FOR_REMOTE_KVS
INSTANCE_TIMEOUT_S = 6.0
KV_TRANSFER_TIMEOUT_S = 2.0
POOLS_FULL_LIMIT_S = 90.0  # how long a run waits for the pools (the target is 60 s)
SEEDED = {"temperature": 0.8, "seed": 4321}
GREEDY = {"temperature": 0}
SHORT_PROMPTS = ("The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,")
# Token ids: a prompt of exactly this length, whatever the tokenizer.
LONG_PROMPT = [1000 + (37 * i) % 20000 for i in range(448)]

LOCAL_SIZES = {"prefill": 2, "decode": 2}
LOCAL_ARGS = (
    *LOCAL, "--num-prefill", "2", "--num-decode", "2", "--dtype", "bfloat16",
    "--kv-cache-memory", "32MiB", "--max-model-len", "512", "--routing-policy", "round_robin",
    "--instance-timeout", str(INSTANCE_TIMEOUT_S),
    "--kv-transfer-timeout", str(KV_TRANSFER_TIMEOUT_S), "--request-timeout", "180",
)  # fmt: skip
LOCAL_ENV = {"PDSERVE_TEST_KV_DELAY_S": str(KV_DELAY_S)}


@dataclass(frozen=True)
class Shape:
    """One kind of request of the load: its prompt and sampling."""

    name: str
    prompt: str | list[int]
    sampling: dict

    def body(self, stream: bool) -> dict:
        # A fresh cache salt per long request: no prefix-cache hit spares its prefill.
        salt = {"cache_salt": uuid.uuid4().hex} if isinstance(self.prompt, list) else {}
        return {"model": MODEL, "prompt": self.prompt, "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": stream, **self.sampling, **salt}  # fmt: skip


def shapes(long: bool = False) -> list[Shape]:
    """A round of the load: greedy streams and one seeded stream."""
    prompts: list[str | list[int]] = [LONG_PROMPT] if long else list(SHORT_PROMPTS)
    kind = "long " if long else ""
    greedy = [Shape(f"{kind}greedy-{i}", p, GREEDY) for i, p in enumerate(prompts)]
    return [*greedy, Shape(f"{kind}seeded", prompts[0], SEEDED)]


class Probe:
    """One streaming request, read on a thread: its text, finish and errors."""

    def __init__(self, server: ServeProcess, shape: Shape) -> None:
        self.shape = shape
        self.chunks: list[str] = []
        self.errors: list[str] = []
        self.finish_reason: str | None = None
        self.request_id: str | None = None  # from the first chunk
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
}


def counters(server: ServeProcess) -> dict[str, float]:
    """The chaos-relevant counters of /metrics, summed over their labels."""
    text = server.get("/metrics").text
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
        self.watch: PoolWatch | None = None
        self.short_within_s = 10.0

    # ---- faults -----------------------------------------------------------------------

    def instances(self) -> dict[str, dict]:
        return self.server.instances()

    def kill(self, instance_id: str) -> None:
        pid = self.instances()[instance_id]["pid"]
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
            os.kill(pid, signal.SIGCONT)

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
                self.expected[shape.name] = response.json()["choices"][0]["text"]

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
        self.watch, self.short_within_s = None, short_within_s
        row = Row(name)
        started = time.monotonic()
        with Load(self.server, kinds, concurrency) as load:
            inject(self, load)  # it waits for the state its fault needs
            self._watch()
            assert self.watch is not None
            row.pools_full_s = self.watch.wait()
            sent = len(load.probes)  # a round more on the pools as they are again
            wait_for(lambda: sum(p.done for p in load.probes[sent:]) >= concurrency, 120,
                     "the load after the fault")  # fmt: skip
        load.join(240)
        self._score(row, load.probes)
        row.leaked_blocks = self._leaked_blocks(row)
        after = counters(self.server)
        row.counters = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        row.migrated = int(row.counters.get("migrated", 0))
        row.retried = int(row.counters.get("retried", 0))
        row.elapsed_s = time.monotonic() - started
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
                if probe.text != self.expected[probe.shape.name]:
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


# ---- the scenarios ------------------------------------------------------------------


def first_ids(load: Load) -> set[str]:
    """Request ids (as instances know them: choice 0) of the streams that have a token."""
    return {f"{p.request_id}-0" for p in load.probes if p.request_id}


def kill_mid_prefill(chaos: Chaos, load: Load) -> None:
    # A request on prefill-0 whose first token has not come: its prompt is computing.
    wait_for(lambda: bool(chaos.in_flight("prefill-0") - first_ids(load)), 60,
             "a request in prefill on prefill-0")  # fmt: skip
    chaos.kill("prefill-0")


def kill_prefill_after_handoff(chaos: Chaos, load: Load) -> None:
    # No new request while the victim is chosen: every one it served has reached its
    # decode instance (D's first output), and streams decode there.
    wait_for(lambda: len(decoding(load, 2)) >= 2, 60, "streams decoding")
    load.hold()
    try:
        wait_for(lambda: not chaos.in_flight("prefill-1"), 60, "prefill-1 to have handed off all")
        chaos.kill("prefill-1")
    finally:
        load.resume()


def decoding(load: Load, at_least: int) -> set[str]:
    return {f"{p.request_id}-0" for p in load.probes
            if p.request_id and not p.done and len(p.chunks) >= at_least}  # fmt: skip


def kill_mid_decode(chaos: Chaos, load: Load) -> None:
    wait_for(lambda: bool(chaos.in_flight("decode-0") & decoding(load, 3)), 60,
             "a stream decoding on decode-0")  # fmt: skip
    chaos.kill("decode-0")


def waiting_for_kv(chaos: Chaos, load: Load, instance_id: str) -> bool:
    one_token = {f"{p.request_id}-0" for p in load.probes
                 if p.request_id and not p.done and len(p.chunks) == 1}  # fmt: skip
    return bool(chaos.in_flight(instance_id) & one_token)


def kill_waiting_for_kv(chaos: Chaos, load: Load) -> None:
    # One token (P's) streamed; D's pull is held back by the test hook.
    wait_for(lambda: waiting_for_kv(chaos, load, "decode-1"), 60,
             "a request on decode-1 waiting for its KV")  # fmt: skip
    chaos.kill("decode-1")


def sever_transfer(chaos: Chaos, load: Load) -> None:
    # prefill-0 stops answering while a decode instance is to pull from it: the pull
    # times out (--kv-transfer-timeout) and the decode instance applies
    # --kv-failure-policy (recompute); prefill-0 resumes before --instance-timeout.
    wait_for(lambda: waiting_for_kv(chaos, load, "prefill-0"), 60,
             "a request handed off by prefill-0 waiting for its pull")  # fmt: skip
    chaos.pause("prefill-0", KV_DELAY_S + KV_TRANSFER_TIMEOUT_S + 1.5)


def pause_decode(chaos: Chaos, load: Load) -> None:
    wait_for(lambda: bool(chaos.in_flight("decode-0") & decoding(load, 2)), 60,
             "a stream decoding on decode-0")  # fmt: skip
    chaos.pause("decode-0", INSTANCE_TIMEOUT_S + 5)


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Callable[[Chaos, Load], None]
    long: bool = False  # long prompts: prefill takes a while
    short_within_s: float = 10.0  # how soon a pool may be seen short


LOCAL_SCENARIOS = [
    Scenario("kill prefill mid-prefill", kill_mid_prefill, long=True),
    Scenario("kill prefill after handoff", kill_prefill_after_handoff),
    Scenario("kill decode mid-decode", kill_mid_decode),
    Scenario("kill decode waiting for KV", kill_waiting_for_kv),
    Scenario("sever a transfer", sever_transfer),
    Scenario("pause decode past timeout", pause_decode, short_within_s=INSTANCE_TIMEOUT_S + 4),
]


def run_scenario(chaos: Chaos, scenario: Scenario) -> Row:
    return chaos.run(scenario.name, scenario.inject, shapes(scenario.long),
                     short_within_s=scenario.short_within_s)  # fmt: skip


@contextmanager
def local_chaos(*extra: str) -> Iterator[Chaos]:
    """The single-node server of the suite (2 prefill + 2 decode, local launcher)."""
    with served(*LOCAL_ARGS, *extra, env=LOCAL_ENV) as server:
        yield Chaos(server, LOCAL_SIZES)


# ---- the table ----------------------------------------------------------------------

COLUMNS = ("scenario", "sent", "completed", "migrated", "retried", "failed", "lost", "wrong",
           "leaked blocks", "pools full (s)")  # fmt: skip


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        full = "not within limit" if r.pools_full_s is None else f"{r.pools_full_s:.1f}"
        cells = (r.scenario, r.sent, r.completed, r.migrated, r.retried, r.failed, r.lost,
                 r.wrong, r.leaked_blocks, full)  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def details(rows: list[Row]) -> str:
    out = []
    for r in rows:
        out.append(f"{r.scenario}: counters {r.counters}, {r.elapsed_s:.0f} s in all")
        out.extend(f"  {note}" for note in r.notes[:10])
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    parser.add_argument("--log-level", default="warning", help="the server's")
    args = parser.parse_args()
    wanted = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    rows = []
    with local_chaos("--log-level", args.log_level) as chaos:
        for scenario in LOCAL_SCENARIOS:
            if not wanted or scenario.name in wanted:
                rows.append(run_scenario(chaos, scenario))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
        print(f"server log: {chaos.server.log_path}")
    print(table(rows))
    print(details(rows))


if __name__ == "__main__":
    main()
