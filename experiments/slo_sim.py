"""The SLO-control trace replayed in the elastic simulator, at a fixed split or under SloPolicy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from experiments.slo_trace import TraceRequest
from pdserve.gateway.slo_policy import (
    Arrival,
    Decision,
    Observation,
    PolicyConfig,
    PoolObservation,
    SloPolicy,
)
from pdserve.planner.sim.elastic import ElasticConfig, ElasticSimulation, Job, PoolState
from pdserve.planner.sim.latency import Calibration


@dataclass(frozen=True)
class SimSetup:
    """The simulated cluster: step latencies, the controller's settings (its instance
    budget and SLOs among them) and how long moving an instance takes."""

    calibration: Calibration
    policy: PolicyConfig
    switch_delay_s: float = 0.5
    start_delay_s: float = 20.0
    handoff_s: float = 0.01
    drain_s: float = 600.0  # after the last arrival, how long requests may still finish

    def elastic(self, prefill: int, decode: int) -> ElasticConfig:
        return ElasticConfig(
            self.calibration.prefill,
            self.calibration.decode,
            prefill,
            decode,
            handoff_s=self.handoff_s,
            switch_delay_s=self.switch_delay_s,
            start_delay_s=self.start_delay_s,
        )


@dataclass
class SimRun:
    label: str
    jobs: list[Job]
    phases: list[str]  # each job's phase
    steps: tuple[np.ndarray, np.ndarray, np.ndarray]  # decode steps: end, gap, batch
    decisions: list[Decision] = field(default_factory=list)
    splits: list[tuple[float, int, int]] = field(default_factory=list)  # (at, P, D) per tick


def jobs_of(trace: list[TraceRequest]) -> list[Job]:
    return [
        Job(i, r.arrival, r.prompt_tokens, max(1, r.output_tokens)) for i, r in enumerate(trace)
    ]


def pool_observation(state: PoolState) -> PoolObservation:
    # The simulator's PoolState mirrors PoolObservation field for field (the planner may
    # not import the gateway).
    return PoolObservation(**asdict(state))


class SimController:
    """Each interval: an Observation from the simulated pools, the policy's decision, the move."""

    def __init__(self, policy: SloPolicy, interval_s: float) -> None:
        self.policy = policy
        self.interval_s = interval_s
        self.decisions: list[Decision] = []
        self.splits: list[tuple[float, int, int]] = []

    def observe(self, sim: ElasticSimulation) -> Observation:
        stats = sim.take_interval()
        return Observation(
            at=sim.loop.now,
            interval_s=self.interval_s,
            prefill=pool_observation(sim.pool_state("prefill")),
            decode=pool_observation(sim.pool_state("decode")),
            ttft_ms=tuple(stats.ttft_ms),
            itl_ms=tuple(stats.itl_ms),
            arrivals=tuple(Arrival(p, o) for p, o in stats.arrivals),
            operator_change=False,
        )

    def tick(self, sim: ElasticSimulation) -> None:
        observation = self.observe(sim)
        decision = self.policy.decide(observation)
        self.decisions.append(decision)
        self.splits.append(
            (
                sim.loop.now,
                observation.prefill.serving + observation.prefill.starting,
                observation.decode.serving + observation.decode.starting,
            )
        )
        self.act(sim, decision)

    def act(self, sim: ElasticSimulation, decision: Decision) -> None:
        if decision.action == "switch":
            assert decision.role_from is not None and decision.role_to is not None
            for _ in range(decision.count):
                sim.switch(decision.role_from, decision.role_to)
        elif decision.action == "start":
            assert decision.role_to is not None
            sim.start(decision.role_to)
        elif decision.action == "stop":
            assert decision.role_to is not None
            sim.stop(decision.role_to)


def finish_run(
    label: str, sim: ElasticSimulation, jobs: list[Job], trace: list[TraceRequest]
) -> SimRun:
    ends, gaps, batches = (np.frombuffer(column, dtype=np.float64) for column in sim.steps)
    return SimRun(label, jobs, [r.phase for r in trace], (ends, gaps, batches))


def run_fixed(setup: SimSetup, prefill: int, decode: int, trace: list[TraceRequest]) -> SimRun:
    sim = ElasticSimulation(setup.elastic(prefill, decode))
    jobs = sim.run(jobs_of(trace))
    return finish_run(f"{prefill}P+{decode}D", sim, jobs, trace)


def run_controlled(setup: SimSetup, start_prefill: int, trace: list[TraceRequest]) -> SimRun:
    """The trace under SloPolicy, from `start_prefill` prefill instances of the budget."""
    interval_s = setup.policy.interval_s
    controller = SimController(SloPolicy(setup.policy, setup.calibration), interval_s)
    budget = setup.policy.instance_budget
    sim = ElasticSimulation(setup.elastic(start_prefill, budget - start_prefill))
    jobs = jobs_of(trace)
    until = (trace[-1].arrival if trace else 0.0) + setup.drain_s
    sim.every(interval_s, controller.tick, until)
    sim.run(jobs)
    run = finish_run("controller", sim, jobs, trace)
    run.decisions, run.splits = controller.decisions, controller.splits
    return run
