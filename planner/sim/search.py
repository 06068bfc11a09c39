"""DistServe's placement question: which P:D split and TP give the most goodput per GPU.

For one deployment, goodput is the highest request rate at which at least
`attainment` of the requests meet both the TTFT and the TPOT SLO (found by doubling
the rate until it fails, then bisecting). Dividing by the deployment's GPUs makes
deployments of different sizes comparable; the search ranks every P:D split (and
colocated instance count) of each TP size within a GPU budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.bench.metrics import meets_slos
from pdserve.planner.sim.latency import Calibration, calibration_for
from pdserve.planner.sim.simulator import ClusterConfig, make_workload, simulate


@dataclass(frozen=True)
class SearchSpec:
    prompt_len: int
    output_len: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    attainment: float = 0.9
    range_ratio: float = 0.0
    num_requests: int = 300
    max_gpus: int = 4
    tp_sizes: tuple[int, ...] = (1,)
    bisect_steps: int = 7
    seed: int = 0


def attainment_at(config: ClusterConfig, spec: SearchSpec, rate: float) -> float:
    workload = make_workload(
        spec.num_requests, rate, spec.prompt_len, spec.output_len, spec.range_ratio, seed=spec.seed
    )
    slos = {"ttft": spec.ttft_slo_ms, "tpot": spec.tpot_slo_ms}
    requests = simulate(config, workload)
    return sum(meets_slos(r.outcome(), slos) for r in requests) / len(requests)


def max_goodput_rate(config: ClusterConfig, spec: SearchSpec) -> float:
    """Requests/s the deployment sustains while meeting the SLO attainment (0 if none)."""

    def good(rate: float) -> bool:
        return attainment_at(config, spec, rate) >= spec.attainment

    low, high = 0.25, 0.5
    if good(low):
        while good(high):
            low, high = high, high * 2
            if high > 1e6:
                return low
    else:
        # Walk down until some rate passes; none within 2^10 means no goodput at all.
        for _ in range(10):
            low, high = low / 2, low
            if good(low):
                break
        else:
            return 0.0
    for _ in range(spec.bisect_steps):
        middle = (low + high) / 2
        low, high = (middle, high) if good(middle) else (low, middle)
    return low


def candidate_configs(base: ClusterConfig, calibrations: dict[int, Calibration], spec: SearchSpec):
    for tp in spec.tp_sizes:
        calibration = calibration_for(calibrations, tp)
        models = replace(base, prefill=calibration.prefill, decode=calibration.decode, tp=tp)
        instances = spec.max_gpus // tp
        for colocated in range(1, instances + 1):
            yield replace(models, num_prefill=colocated, num_decode=0, colocated=True)
        for prefill in range(1, instances):
            for decode in range(1, instances - prefill + 1):
                yield replace(models, num_prefill=prefill, num_decode=decode, colocated=False)


def search_placements(
    base: ClusterConfig, calibrations: dict[int, Calibration], spec: SearchSpec
) -> list[dict]:
    """Every candidate deployment with its goodput, best goodput per GPU first."""
    ranked = []
    for config in candidate_configs(base, calibrations, spec):
        rate = max_goodput_rate(config, spec)
        ranked.append(
            {
                "deployment": config.label(),
                "colocated": config.colocated,
                "prefill_instances": config.num_prefill,
                "decode_instances": 0 if config.colocated else config.num_decode,
                "tp": config.tp,
                "gpus": config.gpus,
                "goodput_requests_per_s": rate,
                "goodput_per_gpu": rate / config.gpus,
            }
        )
    ranked.sort(key=lambda row: (-row["goodput_per_gpu"], row["gpus"]))
    return ranked
