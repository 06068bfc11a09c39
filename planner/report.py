"""`pdserve plan`: put memory, capacity, cost and simulation together; print them.

Each section runs when its inputs are there: memory needs only the model config;
capacity needs a load profile and phase throughputs (given, from a sweep, or derived
from a calibration); cost needs a GPU price; simulation needs a calibration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.planner.capacity import LoadProfile, PhaseThroughput, plan_capacity
from pdserve.planner.cost import CostInputs, plan_cost
from pdserve.planner.memory import MemoryInputs, plan_memory
from pdserve.planner.model_config import ModelShape
from pdserve.planner.sim.latency import Calibration, calibration_for, prefill_pairs
from pdserve.planner.sim.search import SearchSpec, search_placements
from pdserve.planner.sim.simulator import (
    ClusterConfig,
    make_workload,
    simulate,
    summarize_simulation,
)


@dataclass
class PlanRequest:
    shape: ModelShape
    memory: MemoryInputs
    load: LoadProfile | None = None
    throughput: PhaseThroughput | None = None
    target_utilizations: list[float] = field(default_factory=lambda: [0.65, 0.70])
    tp: int | None = None
    costs: CostInputs | None = None
    calibrations: dict[int, Calibration] = field(default_factory=dict)
    simulate_requests: int = 500
    search_max_gpus: int | None = None
    seed: int = 0


def throughput_from_calibration(
    calibration: Calibration, load: LoadProfile, max_num_seqs: int, token_budget: int
) -> PhaseThroughput:
    """Phase throughputs the fitted step models imply for this profile.

    Prefill: full steps of whole prompts. Decode: the largest batch (up to
    max_num_seqs) whose step still meets the ITL SLO, at the mean context length.
    """
    prompt = max(1, int(load.prompt_tokens))
    step_tokens = max(token_budget, prompt)
    prompts_per_step = step_tokens / prompt
    prefill_s = calibration.prefill.predict(
        step_tokens, int(prompts_per_step * prefill_pairs(prompt))
    )
    context = int(load.prompt_tokens + load.output_tokens / 2)
    best_batch = 1
    for batch in range(1, max_num_seqs + 1):
        step = calibration.decode.predict(batch, batch * context)
        if load.itl_slo_ms is not None and step * 1000.0 > load.itl_slo_ms:
            break
        best_batch = batch
    decode_s = calibration.decode.predict(best_batch, best_batch * context)
    return PhaseThroughput(
        step_tokens / prefill_s / calibration.tp,
        best_batch / decode_s / calibration.tp,
        f"calibration (decode batch {best_batch})",
    )


def deployment_costs(request: PlanRequest, capacity: dict) -> list[dict]:
    assert request.costs is not None
    rows = []
    prefill_full = capacity["prefill_gpus_at_full_load"]
    colocated_share = prefill_full / capacity["colocated_gpus_at_full_load"]
    for target in capacity["at_target_utilization"]:
        tp = capacity["tp"]
        disaggregated = plan_cost(
            request.costs,
            target["disaggregated_gpus"],
            target["prefill_instances"] * tp / target["disaggregated_gpus"],
            capacity["input_tokens_per_s"],
            capacity["output_tokens_per_s"],
        )
        colocated = plan_cost(
            request.costs,
            target["colocated_gpus"],
            colocated_share,
            capacity["input_tokens_per_s"],
            capacity["output_tokens_per_s"],
        )
        rows.append(
            {
                "target_utilization": target["target_utilization"],
                "disaggregated": disaggregated,
                "colocated": colocated,
            }
        )
    return rows


def simulate_plan(request: PlanRequest, capacity: dict) -> dict:
    """Predicted latencies of the planned deployments at the profile's peak rate."""
    assert request.load is not None
    tp = capacity["tp"]
    calibration = calibration_for(request.calibrations, tp)
    base = ClusterConfig(
        calibration.prefill,
        calibration.decode,
        tp=tp,
        max_num_batched_tokens=request.memory.max_num_batched_tokens,
        max_num_seqs=request.memory.max_num_seqs,
    )
    target = capacity["at_target_utilization"][0]
    deployments = {
        "disaggregated": replace(
            base, num_prefill=target["prefill_instances"], num_decode=target["decode_instances"]
        ),
        "colocated": replace(base, num_prefill=target["colocated_instances"], colocated=True),
    }
    workload = make_workload(
        request.simulate_requests,
        request.load.requests_per_s,
        int(request.load.prompt_tokens),
        int(request.load.output_tokens),
        seed=request.seed,
    )
    slos = {}
    if request.load.ttft_slo_ms is not None:
        slos["ttft"] = request.load.ttft_slo_ms
    if request.load.itl_slo_ms is not None:
        slos["tpot"] = request.load.itl_slo_ms
    result: dict[str, Any] = {}
    for name, config in deployments.items():
        summary = summarize_simulation(simulate(config, workload), goodput_slos_ms=slos or None)
        summary["deployment"] = config.label()
        summary["gpus"] = config.gpus
        result[name] = summary
    if request.search_max_gpus:
        spec = SearchSpec(
            prompt_len=int(request.load.prompt_tokens),
            output_len=int(request.load.output_tokens),
            ttft_slo_ms=request.load.ttft_slo_ms or 1e9,
            tpot_slo_ms=request.load.itl_slo_ms or 1e9,
            max_gpus=request.search_max_gpus,
            tp_sizes=tuple(sorted({1, *request.calibrations})),
            seed=request.seed,
        )
        result["placement_search"] = search_placements(base, request.calibrations, spec)
    return result


def choose_tp(request: PlanRequest, memory: dict) -> int:
    if request.tp is not None:
        return request.tp
    return memory["tp_needed_for_max_num_seqs"] or memory["tp_needed_for_one_sequence"] or 1


def build_plan(request: PlanRequest) -> dict:
    memory = plan_memory(request.shape, request.memory)
    plan: dict = {"memory": memory, "capacity": None, "cost": None, "simulation": None}
    tp = choose_tp(request, memory)
    throughput = request.throughput
    if throughput is None and request.load is not None and request.calibrations:
        calibration = calibration_for(request.calibrations, tp)
        throughput = throughput_from_calibration(
            calibration,
            request.load,
            request.memory.max_num_seqs,
            request.memory.max_num_batched_tokens,
        )
    if request.load is None or throughput is None:
        return plan
    capacity = plan_capacity(request.load, throughput, request.target_utilizations, tp)
    plan["capacity"] = capacity
    if request.costs is not None:
        plan["cost"] = deployment_costs(request, capacity)
    if request.calibrations:
        plan["simulation"] = simulate_plan(request, capacity)
    return plan
