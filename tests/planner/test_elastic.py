"""The elastic simulator: requests finish, and pools change split as the real ones do."""

from __future__ import annotations

import pytest

from pdserve.planner.sim.elastic import ElasticConfig, ElasticSimulation, Job
from pdserve.planner.sim.latency import StepLatencyModel

PREFILL = StepLatencyModel(intercept_s=0.05, per_token_s=0.001)
DECODE = StepLatencyModel(intercept_s=0.02, per_token_s=0.001)


def simulation(prefill: int, decode: int, **extra) -> ElasticSimulation:
    return ElasticSimulation(
        ElasticConfig(PREFILL, DECODE, prefill, decode, handoff_s=0.0, **extra)
    )


def jobs(count: int, prompt: int = 100, output: int = 50, gap: float = 0.0) -> list[Job]:
    return [Job(i, i * gap, prompt, output) for i in range(count)]


def test_a_lone_request_takes_its_step_times() -> None:
    (job,) = simulation(1, 1).run(jobs(1, prompt=100, output=11))
    assert job.first_token == pytest.approx(0.05 + 0.1)
    # Ten decode steps of one sequence each (no pair term in this model).
    assert job.finish == pytest.approx(job.first_token + 10 * (0.02 + 0.001))
    assert job.tpot() == pytest.approx(0.021)


def test_every_request_finishes_and_steps_are_recorded() -> None:
    sim = simulation(2, 2)
    done = sim.run(jobs(40, gap=0.05))
    assert all(j.finish is not None and j.generated == j.output_len for j in done)
    ends, gaps, batches = sim.steps
    assert len(ends) == len(gaps) == len(batches) > 0
    assert max(batches) > 1  # continuous batching shared steps


def test_a_decode_instance_switched_away_hands_its_sequences_on() -> None:
    sim = simulation(1, 2, switch_delay_s=0.3)
    batch = jobs(6, output=400)
    sim.loop.schedule(2.0, lambda: sim.switch("decode", "prefill"))
    states = []
    sim.loop.schedule(2.0, lambda: states.append(sim.pool_state("prefill")))
    sim.loop.schedule(2.4, lambda: states.append(sim.pool_state("prefill")))
    sim.run(batch)
    assert [(s.serving, s.starting) for s in states] == [(1, 1), (2, 0)]
    migrated = [j for j in batch if j.migrations]
    assert migrated and all(j.finish is not None for j in batch)
    assert len(sim.decode) == 1 and len(sim.prefill) == 2


def test_a_prefill_instance_switched_away_finishes_its_prompts_first() -> None:
    sim = simulation(2, 1, switch_delay_s=0.1)
    batch = jobs(8, prompt=1500, output=5)
    sim.loop.schedule(0.01, lambda: sim.switch("prefill", "decode"))
    seen = []
    sim.loop.schedule(0.5, lambda: seen.append(sim.pool_state("decode")))
    sim.run(batch)
    assert seen[0].serving == 1 and seen[0].starting == 1  # still draining its prompts
    assert all(j.finish is not None for j in batch)
    assert len(sim.decode) == 2 and len(sim.prefill) == 1


def test_start_and_stop_change_the_pools() -> None:
    sim = simulation(1, 2, start_delay_s=1.0)
    sim.loop.schedule(0.5, lambda: sim.start("prefill"))
    sim.loop.schedule(0.5, lambda: sim.stop("decode"))
    sim.run(jobs(20, gap=0.2))
    assert len(sim.prefill) == 2 and len(sim.decode) == 1


def test_the_last_instance_of_a_pool_stays() -> None:
    sim = simulation(1, 1)
    with pytest.raises(ValueError, match="last serving decode"):
        sim.switch("decode", "prefill")
    with pytest.raises(ValueError, match="last serving prefill"):
        sim.stop("prefill")
