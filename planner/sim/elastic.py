"""A P/D simulation whose pools change split while it runs: role switches, starts, stops.

Lean on purpose (hundreds of instances, hours of traffic in seconds): a decode instance
keeps its sequences' context sum and a heap of the steps they finish at instead of a
token list per request, so a step costs O(1) plus its finishers. Each request keeps its
arrival, first-token and finish times; its TPOT is (finish - first token) / (tokens - 1),
and the decode steps' gaps are kept with their batch sizes for the ITL percentiles.

Changes follow the real pools (`docs/operations.md`, "Admin endpoints"): a prefill
instance switched to decode takes no new prompts, finishes its queue, then after the
switch delay serves decode; a decode instance switched to prefill hands its sequences to
the other decode instances at once (each recomputes its context there before it decodes
on: a prefill of prompt and output so far, on the prefill step model) and serves prefill
after the switch delay. A started instance serves after the start delay; a stopped one
takes nothing new and leaves when its work is done. A policy acts through `switch`,
`start` and `stop` and reads `pool_state` and `take_interval`, called from `every`.
"""

from __future__ import annotations

import functools
import heapq
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.planner.sim.latency import StepLatencyModel, prefill_pairs
from pdserve.planner.sim.simulator import EventLoop

ITL_SAMPLE = 1000  # gaps an interval's statistics keep (the newest)


@dataclass(frozen=True)
class ElasticConfig:
    prefill: StepLatencyModel
    decode: StepLatencyModel
    num_prefill: int
    num_decode: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 524288  # per decode instance
    handoff_s: float = 0.01  # a handoff's KV pull
    switch_delay_s: float = 0.5
    start_delay_s: float = 20.0


@dataclass(eq=False)
class Job:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    prefilled: int = 0
    generated: int = 0  # tokens out so far, the first included
    first_token: float | None = None
    finish: float | None = None
    migrations: int = 0

    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None or self.output_len < 2:
            return None
        return (self.finish - self.first_token) / (self.output_len - 1)


@dataclass(frozen=True)
class PoolState:
    serving: int
    starting: int
    queued: int
    running: int
    kv_usage: float


@dataclass
class IntervalStats:
    arrivals: list[tuple[int, int]] = field(default_factory=list)  # (prompt, output)
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: deque[float] = field(default_factory=lambda: deque(maxlen=ITL_SAMPLE))


class PrefillWorker:
    """Chunked prefill, first come first served, up to the token budget per step."""

    def __init__(self, sim: ElasticSimulation) -> None:
        self.sim = sim
        self.queue: deque[Job] = deque()
        self.queued_tokens = 0
        self.in_step = 0
        self.busy = False
        self.on_empty: Callable[[], None] | None = None  # a drain's continuation

    def idle(self) -> bool:
        return not self.busy and not self.queue

    def submit(self, job: Job) -> None:
        self.queue.append(job)
        self.queued_tokens += job.prompt_len - job.prefilled
        if not self.busy:
            self.busy = True
            self.sim.loop.schedule(self.sim.loop.now, self.start_step)

    def start_step(self) -> None:
        budget, chunks = self.sim.config.max_num_batched_tokens, []
        for job in self.queue:
            if budget <= 0:
                break
            take = min(job.prompt_len - job.prefilled, budget)
            chunks.append((job, take))
            budget -= take
        if not chunks:
            self.busy = False
            then = self.on_empty
            if then is not None:
                self.on_empty = None
                then()
            return
        tokens = sum(n for _, n in chunks)
        pairs = sum(prefill_pairs(n, job.prefilled) for job, n in chunks)
        self.in_step = len(chunks)
        seconds = self.sim.config.prefill.predict(tokens, pairs)
        self.sim.loop.schedule(self.sim.loop.now + seconds, lambda: self.end_step(chunks))

    def end_step(self, chunks: list[tuple[Job, int]]) -> None:
        now = self.sim.loop.now
        for job, n in chunks:
            job.prefilled += n
            self.queued_tokens -= n
            if job.prefilled == job.prompt_len:
                self.queue.popleft()  # chunks are taken from the head, in order
                job.first_token, job.generated = now, 1
                self.sim.first_token(job)
        self.in_step = 0
        self.start_step()


class DecodeWorker:
    """Continuous batching; handoffs join at step boundaries once their KV is pulled."""

    def __init__(self, sim: ElasticSimulation) -> None:
        self.sim = sim
        self.waiting: deque[tuple[Job, float]] = deque()  # (job, seconds its KV takes)
        self.pulling: list[tuple[float, Job]] = []
        self.finishing: list[tuple[int, int, Job]] = []  # (finish step, index, job)
        self.context = 0  # tokens the running sequences attend to
        self.steps = 0
        self.busy = False
        self.retired = False  # switched away: a step in flight ends without effect
        self.wake_at: float | None = None
        self.on_empty: Callable[[], None] | None = None

    def load(self) -> int:
        return len(self.waiting) + len(self.pulling) + len(self.finishing)

    def submit(self, job: Job, pull_s: float) -> None:
        self.waiting.append((job, pull_s))
        if not self.busy:
            self.admit()
            self.plan_wake()

    def admit(self) -> None:
        config, now = self.sim.config, self.sim.loop.now
        ready = [job for at, job in self.pulling if at <= now]
        self.pulling = [(at, job) for at, job in self.pulling if at > now]
        for job in ready:
            heapq.heappush(
                self.finishing, (self.steps + job.output_len - job.generated, job.index, job)
            )
            self.context += job.prompt_len + job.generated
        seats = config.max_num_seqs - len(self.finishing) - len(self.pulling)
        while self.waiting and seats > 0:
            job, pull_s = self.waiting[0]
            if self.context + job.prompt_len + job.output_len > config.kv_capacity_tokens:
                break  # the KV cache has no room for it yet
            self.waiting.popleft()
            self.pulling.append((now + pull_s, job))
            seats -= 1

    def plan_wake(self) -> None:
        if not self.pulling:
            then = self.on_empty
            if not self.finishing and not self.waiting and then is not None:
                self.on_empty = None
                then()
            return
        at = min(ready for ready, _ in self.pulling)
        if self.wake_at is None or at < self.wake_at:
            self.wake_at = at
            self.sim.loop.schedule(at, self.on_wake)

    def on_wake(self) -> None:
        if self.busy or self.wake_at is None or self.sim.loop.now < self.wake_at:
            return
        self.wake_at = None
        self.start_step()

    def start_step(self) -> None:
        self.admit()
        if not self.finishing:
            self.busy = False
            self.plan_wake()
            return
        self.busy, self.wake_at = True, None
        batch = len(self.finishing)
        seconds = self.sim.config.decode.predict(batch, self.context)
        self.sim.loop.schedule(self.sim.loop.now + seconds, lambda: self.end_step(batch, seconds))

    def end_step(self, batch: int, seconds: float) -> None:
        if self.retired:
            self.busy = False
            return
        now = self.sim.loop.now
        self.steps += 1
        self.context += batch
        self.sim.record_step(now, seconds, batch)
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, job = heapq.heappop(self.finishing)
            job.generated, job.finish = job.output_len, now
            self.context -= job.prompt_len + job.output_len
            self.sim.finished += 1
        self.start_step()

    def idle(self) -> bool:
        return not self.busy and self.load() == 0

    def evict(self) -> list[tuple[Job, bool]]:
        """Every sequence here with the tokens it has so far, and whether it was running
        (its KV is here, so it is recomputed elsewhere; the others' is still on their
        prefill instance). The worker is left empty."""
        jobs = [(job, False) for job, _ in self.waiting] + [(job, False) for _, job in self.pulling]
        for finish_step, _, job in self.finishing:
            job.generated = job.output_len - (finish_step - self.steps)
            jobs.append((job, True))
        self.waiting.clear()
        self.pulling, self.finishing, self.context = [], [], 0
        self.retired = True
        return jobs


class ElasticSimulation:
    """Requests through prefill and decode pools whose membership a policy changes."""

    def __init__(self, config: ElasticConfig) -> None:
        if config.num_prefill < 1 or config.num_decode < 1:
            raise ValueError("a deployment needs at least one instance of each kind")
        self.config = config
        self.loop = EventLoop()
        self.prefill = [PrefillWorker(self) for _ in range(config.num_prefill)]
        self.decode = [DecodeWorker(self) for _ in range(config.num_decode)]
        self.starting = {"prefill": 0, "decode": 0}
        self.orphans: list[Job] = []  # sequences waiting for a decode instance
        self.interval = IntervalStats()
        self.steps = (array("d"), array("d"), array("d"))  # end time, gap, batch
        self.finished = 0
        self.total = 0

    # ---- traffic -----------------------------------------------------------------------
    def arrive(self, job: Job) -> None:
        self.interval.arrivals.append((job.prompt_len, job.output_len))
        min(self.prefill, key=lambda w: w.queued_tokens).submit(job)

    def first_token(self, job: Job) -> None:
        now = self.loop.now
        self.interval.ttft_ms.append((now - job.arrival) * 1e3)
        if job.output_len == 1:
            job.finish = now
            self.finished += 1
            return
        self.place(job, self.config.handoff_s)

    def place(self, job: Job, pull_s: float) -> None:
        if not self.decode:
            self.orphans.append(job)
            return
        min(self.decode, key=DecodeWorker.load).submit(job, pull_s)

    def record_step(self, end: float, seconds: float, batch: int) -> None:
        self.interval.itl_ms.append(seconds * 1e3)
        for column, value in zip(self.steps, (end, seconds, batch), strict=True):
            column.append(value)

    # ---- what a policy reads -----------------------------------------------------------
    def pool_state(self, role: str) -> PoolState:
        if role == "prefill":
            queued = sum(len(w.queue) - w.in_step for w in self.prefill)
            running = sum(w.in_step for w in self.prefill)
            return PoolState(len(self.prefill), self.starting[role], queued, running, 0.0)
        capacity = self.config.kv_capacity_tokens
        queued = sum(len(w.waiting) + len(w.pulling) for w in self.decode) + len(self.orphans)
        running = sum(len(w.finishing) for w in self.decode)
        kv = sum(w.context for w in self.decode) / (capacity * max(1, len(self.decode)))
        return PoolState(len(self.decode), self.starting[role], queued, running, kv)

    def take_interval(self) -> IntervalStats:
        stats, self.interval = self.interval, IntervalStats()
        return stats

    # ---- what a policy does ------------------------------------------------------------
    def switch(self, role_from: str, role_to: str) -> None:
        if role_from == role_to or {role_from, role_to} != {"prefill", "decode"}:
            raise ValueError(f"cannot switch {role_from} -> {role_to}")
        pool: list = self.prefill if role_from == "prefill" else self.decode
        if len(pool) <= 1:
            raise ValueError(f"the last serving {role_from} instance cannot switch")
        self.starting[role_to] += 1
        if role_from == "prefill":
            prefill = min(self.prefill, key=lambda w: w.queued_tokens)
            self.prefill.remove(prefill)
            self.after_drain(prefill, lambda: self.join_later("decode", self.config.switch_delay_s))
            return
        # The fewest tokens to recompute: its running requests are handed back.
        decode = min(self.decode, key=lambda w: (w.context, w.load()))
        self.decode.remove(decode)
        for job, running in decode.evict():
            job.migrations += 1
            self.place(job, self.recompute_s(job) if running else self.config.handoff_s)
        self.join_later("prefill", self.config.switch_delay_s)

    def start(self, role: str) -> None:
        self.starting[role] += 1
        self.join_later(role, self.config.start_delay_s)

    def stop(self, role: str) -> None:
        pool = self.prefill if role == "prefill" else self.decode
        if len(pool) <= 1:
            raise ValueError(f"the last serving {role} instance cannot stop")
        self.after_drain(pool.pop(), lambda: None)

    def after_drain(self, worker: PrefillWorker | DecodeWorker, then: Callable[[], None]) -> None:
        """Call `then` once the worker, out of its pool, has finished its work."""
        if worker.idle():
            then()
            return
        worker.on_empty = then

    def join_later(self, role: str, delay_s: float) -> None:
        self.loop.schedule(self.loop.now + delay_s, lambda: self.join(role))

    def join(self, role: str) -> None:
        self.starting[role] -= 1
        if role == "prefill":
            self.prefill.append(PrefillWorker(self))
            return
        self.decode.append(DecodeWorker(self))
        orphans, self.orphans = self.orphans, []
        for job in orphans:
            self.place(job, self.recompute_s(job))

    def recompute_s(self, job: Job) -> float:
        """Rebuilding a sequence's KV on its new decode instance (prompt and output so far)."""
        tokens = job.prompt_len + job.generated
        return self.config.prefill.predict(tokens, prefill_pairs(tokens))

    # ---- running -----------------------------------------------------------------------
    def every(
        self, interval_s: float, tick: Callable[[ElasticSimulation], None], until: float
    ) -> None:
        """Call `tick` every interval while requests remain unfinished, up to `until`."""

        def fire() -> None:
            if self.finished >= self.total or self.loop.now > until:
                return
            tick(self)
            self.loop.schedule(self.loop.now + interval_s, fire)

        self.loop.schedule(interval_s, fire)

    def run(self, jobs: list[Job]) -> list[Job]:
        self.total += len(jobs)
        for job in jobs:
            self.loop.schedule(job.arrival, functools.partial(self.arrive, job))
        self.loop.run()
        return jobs
