"""A discrete-event simulator of a P/D (or colocated) deployment.

Requests arrive on a schedule; the global scheduler sends each to the prefill
instance with the fewest queued prompt tokens. A prefill instance runs chunked
prefill: each step takes queued prompt tokens first-come first-served up to its
token budget and lasts what the prefill latency model says. When a prompt is done
its first token is out (TTFT) and the request goes to the least loaded decode
instance, which runs continuous batching: every step gives each running sequence
one token and lasts what the decode model says for that batch and its contexts.

The handoff follows the real decode loop, which admits new work only between steps:
an idle decode instance starts pulling the KV at once, a busy one at the end of the
step in flight; the pull takes `handoff_base_s + handoff_per_token_s * prompt_len`
(message, allocation and transfer), and the request joins the first step that starts
after it is done. Behind a busy decode instance the second token therefore waits out
the step in flight and one more before its own.

A colocated instance does both in one step, decode tokens first and prompt chunks in
the remaining budget, so prefill work lengthens the decode steps it shares.

The result is the same per-request record `bench serve` keeps, so the simulator's
predictions and the measurements are summarized by the same code.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.datasets import sample_lengths
from pdserve.bench.metrics import RequestOutcome, summarize
from pdserve.planner.sim.latency import StepLatencyModel, prefill_pairs


@dataclass
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    prefilled: int = 0
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None

    def context_len(self) -> int:
        """Tokens a decode step of this request attends to."""
        return self.prompt_len + len(self.token_times)

    def outcome(self) -> RequestOutcome:
        times = self.token_times
        return RequestOutcome(
            success=self.finish is not None,
            prompt_len=self.prompt_len,
            output_tokens=len(times),
            ttft=times[0] - self.arrival if times else 0.0,
            itl=[b - a for a, b in zip(times, times[1:], strict=False)],
            latency=(self.finish or self.arrival) - self.arrival,
            start_time=self.arrival,
        )


@dataclass(frozen=True)
class ClusterConfig:
    prefill: StepLatencyModel
    decode: StepLatencyModel
    num_prefill: int = 1  # colocated: the number of instances
    num_decode: int = 1  # ignored when colocated
    colocated: bool = False
    tp: int = 1
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    handoff_base_s: float = 0.0
    handoff_per_token_s: float = 0.0

    @property
    def gpus(self) -> int:
        instances = self.num_prefill if self.colocated else self.num_prefill + self.num_decode
        return instances * self.tp

    def label(self) -> str:
        if self.colocated:
            return f"{self.num_prefill} colocated x TP{self.tp}"
        return f"{self.num_prefill}P+{self.num_decode}D x TP{self.tp}"


@dataclass(frozen=True)
class Workload:
    arrivals: list[float]
    prompt_lens: list[int]
    output_lens: list[int]


def make_workload(
    num_requests: int,
    request_rate: float,
    prompt_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    return Workload(
        [float(t) for t in arrival_offsets(num_requests, request_rate, burstiness, seed)],
        [int(n) for n in sample_lengths(rng, prompt_len, range_ratio, num_requests)],
        [int(n) for n in sample_lengths(rng, output_len, range_ratio, num_requests)],
    )


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.counter = itertools.count()

    def schedule(self, at: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (at, next(self.counter), action))

    def run(self) -> None:
        while self.events:
            self.now, _, action = heapq.heappop(self.events)
            action()


class SimulatedInstance:
    """Shared step machinery: one step at a time, the next starts when it ends."""

    def __init__(self, loop: EventLoop, config: ClusterConfig) -> None:
        self.loop = loop
        self.config = config
        self.busy = False
        self.queue: deque[SimRequest] = deque()  # waiting for (more) prefill
        self.running: list[SimRequest] = []  # decoding

    def load(self) -> int:
        return len(self.queue) + len(self.running)

    def queued_prompt_tokens(self) -> int:
        return sum(r.prompt_len - r.prefilled for r in self.queue)

    def wake(self) -> None:
        # Start on an event at the same instant, queued behind the ones already due:
        # requests that arrive together are scheduled together, as a real step would.
        if not self.busy:
            self.busy = True
            self.loop.schedule(self.loop.now, self.start_step)

    def take_chunks(self, budget: int, seq_room: int) -> list[tuple[SimRequest, int]]:
        chunks: list[tuple[SimRequest, int]] = []
        for request in self.queue:
            if budget <= 0 or len(chunks) >= seq_room:
                break
            take = min(request.prompt_len - request.prefilled, budget)
            chunks.append((request, take))
            budget -= take
        return chunks

    def start_step(self) -> None:
        raise NotImplementedError


class SimulatedPrefill(SimulatedInstance):
    def __init__(self, loop: EventLoop, config: ClusterConfig, on_prefilled) -> None:
        super().__init__(loop, config)
        self.on_prefilled = on_prefilled

    def submit(self, request: SimRequest) -> None:
        self.queue.append(request)
        self.wake()

    def start_step(self) -> None:
        chunks = self.take_chunks(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        if not chunks:
            self.busy = False
            return
        self.busy = True
        tokens = sum(n for _, n in chunks)
        pairs = sum(prefill_pairs(n, r.prefilled) for r, n in chunks)
        duration = self.config.prefill.predict(tokens, pairs)
        self.loop.schedule(self.loop.now + duration, lambda: self.end_step(chunks))

    def end_step(self, chunks: list[tuple[SimRequest, int]]) -> None:
        for request, n in chunks:
            request.prefilled += n
            if request.prefilled == request.prompt_len:
                self.queue.remove(request)
                request.token_times.append(self.loop.now)
                self.on_prefilled(request)
        self.start_step()


class SimulatedDecode(SimulatedInstance):
    """Continuous batching of handed-off requests, their KV pulled between steps."""

    def __init__(self, loop: EventLoop, config: ClusterConfig) -> None:
        super().__init__(loop, config)
        self.pulling: list[tuple[float, SimRequest]] = []  # (KV ready at, request)
        self.wake_at: float | None = None  # an idle instance steps when a pull is done

    def load(self) -> int:
        return len(self.queue) + len(self.pulling) + len(self.running)

    def submit(self, request: SimRequest) -> None:
        self.queue.append(request)
        if not self.busy:  # an idle loop takes the handoff at once
            self.begin_pulls()
            self.plan_wake()

    def pull_seconds(self, request: SimRequest) -> float:
        config = self.config
        return config.handoff_base_s + config.handoff_per_token_s * request.prompt_len

    def begin_pulls(self) -> None:
        seats = self.config.max_num_seqs - len(self.running) - len(self.pulling)
        while self.queue and seats > 0:
            request = self.queue.popleft()
            self.pulling.append((self.loop.now + self.pull_seconds(request), request))
            seats -= 1

    def join_ready(self) -> None:
        now = self.loop.now
        self.running.extend(r for ready, r in self.pulling if ready <= now)
        self.pulling = [(ready, r) for ready, r in self.pulling if ready > now]

    def plan_wake(self) -> None:
        if not self.pulling:
            return
        at = min(ready for ready, _ in self.pulling)
        if self.wake_at is None or at < self.wake_at:
            self.wake_at = at
            self.loop.schedule(at, self.on_wake)

    def on_wake(self) -> None:
        if self.busy or self.wake_at is None or self.loop.now < self.wake_at:
            return  # a step already started, or an earlier wake took its place
        self.wake_at = None
        self.start_step()

    def start_step(self) -> None:
        # A step boundary: settle finished pulls, admit new handoffs, then step.
        self.join_ready()
        self.begin_pulls()
        if not self.running:
            self.busy = False
            self.plan_wake()
            return
        self.busy = True
        self.wake_at = None
        batch = list(self.running)
        pairs = sum(r.context_len() for r in batch)
        duration = self.config.decode.predict(len(batch), pairs)
        self.loop.schedule(self.loop.now + duration, lambda: self.end_step(batch))

    def end_step(self, batch: list[SimRequest]) -> None:
        for request in batch:
            request.token_times.append(self.loop.now)
            if len(request.token_times) == request.output_len:
                request.finish = self.loop.now
                self.running.remove(request)
        self.start_step()


class SimulatedColocated(SimulatedInstance):
    """Prefill chunks and decode tokens share each step (chunked prefill, decode first)."""

    def submit(self, request: SimRequest) -> None:
        self.queue.append(request)
        self.wake()

    def start_step(self) -> None:
        config = self.config
        decodes = self.running[: config.max_num_seqs]
        seq_room = config.max_num_seqs - len(decodes)
        chunks = self.take_chunks(config.max_num_batched_tokens - len(decodes), seq_room)
        if not decodes and not chunks:
            self.busy = False
            return
        self.busy = True
        duration = 0.0
        if chunks:
            tokens = sum(n for _, n in chunks)
            pairs = sum(prefill_pairs(n, r.prefilled) for r, n in chunks)
            duration += config.prefill.predict(tokens, pairs)
        if decodes:
            duration += config.decode.predict(len(decodes), sum(r.context_len() for r in decodes))
        if chunks and decodes:
            # One step, one fixed cost: don't pay both intercepts.
            duration -= min(config.prefill.intercept_s, config.decode.intercept_s)
        self.loop.schedule(self.loop.now + duration, lambda: self.end_step(decodes, chunks))

    def end_step(self, decodes: list[SimRequest], chunks: list[tuple[SimRequest, int]]) -> None:
        now = self.loop.now
        for request in decodes:
            request.token_times.append(now)
            if len(request.token_times) == request.output_len:
                request.finish = now
                self.running.remove(request)
        for request, n in chunks:
            request.prefilled += n
            if request.prefilled == request.prompt_len:
                self.queue.remove(request)
                request.token_times.append(now)
                if request.output_len == 1:
                    request.finish = now
                else:
                    self.running.append(request)
        self.start_step()


class Simulation:
    def __init__(self, config: ClusterConfig) -> None:
        if config.num_prefill < 1 or (not config.colocated and config.num_decode < 1):
            raise ValueError("a deployment needs at least one instance of each kind")
        self.config = config
        self.loop = EventLoop()
        if config.colocated:
            self.front: list[SimulatedInstance] = [
                SimulatedColocated(self.loop, config) for _ in range(config.num_prefill)
            ]
            self.decoders: list[SimulatedDecode] = []
        else:
            self.front = [
                SimulatedPrefill(self.loop, config, self.hand_off)
                for _ in range(config.num_prefill)
            ]
            self.decoders = [SimulatedDecode(self.loop, config) for _ in range(config.num_decode)]

    def hand_off(self, request: SimRequest) -> None:
        if request.output_len == 1:
            request.finish = self.loop.now
            return
        min(self.decoders, key=lambda d: d.load()).submit(request)

    def arrive(self, request: SimRequest) -> None:
        # The gateway's load-aware policy: fewest queued prompt tokens, then fewest
        # requests in flight (colocated).
        if self.config.colocated:
            target = min(self.front, key=lambda i: (i.queued_prompt_tokens(), i.load()))
        else:
            target = min(self.front, key=lambda i: i.queued_prompt_tokens())
        target.submit(request)  # type: ignore[attr-defined]

    def run(self, workload: Workload) -> list[SimRequest]:
        requests = [
            SimRequest(i, t, p, max(1, o))
            for i, (t, p, o) in enumerate(
                zip(workload.arrivals, workload.prompt_lens, workload.output_lens, strict=True)
            )
        ]
        for request in requests:
            self.loop.schedule(request.arrival, functools.partial(self.arrive, request))
        self.loop.run()
        return requests


def simulate(config: ClusterConfig, workload: Workload) -> list[SimRequest]:
    return Simulation(config).run(workload)


def summarize_simulation(
    requests: list[SimRequest],
    percentiles: list[float] | tuple[float, ...] = (50.0, 95.0, 99.0),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict:
    """The simulated run in `bench serve`'s result fields."""
    outcomes = [r.outcome() for r in requests]
    finishes = [r.finish for r in requests if r.finish is not None]
    duration = (max(finishes) - min(r.arrival for r in requests)) if finishes else 0.0
    result = summarize(outcomes, duration, percentiles, goodput_slos_ms=goodput_slos_ms)
    for name in ("input_lens", "output_lens", "ttfts", "itls", "errors"):
        result.pop(name)
    return result
