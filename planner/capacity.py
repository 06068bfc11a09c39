"""From a load profile and per-GPU phase throughputs to GPU counts.

- Token rates: requests/s = requests per minute / 60; input tokens/s = requests/s x
  prompt tokens; output tokens/s = requests/s x output tokens.
- At full load a phase needs (its token rate / per-GPU throughput) GPUs. Running it at a
  target utilization u instead (65-70% leaves room for bursts) takes full / u GPUs,
  rounded up to whole instances of TP GPUs each.
- Disaggregated: prefill and decode pools sized apart; their ratio is the P:D split.
  Colocated: every GPU time-shares both phases, so it needs the sum of both.
- TTFT sanity check: a prefill instance seen as an M/D/1 queue (Poisson arrivals,
  fixed service time s = prompt tokens / instance throughput) waits on average
  rho*s / (2(1 - rho)); mean TTFT = s + wait. The utilization where that reaches the
  TTFT SLO bounds how hard the prefill pool may run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadProfile:
    requests_per_minute: float
    prompt_tokens: float
    output_tokens: float
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None

    def validate(self) -> None:
        if self.requests_per_minute <= 0 or self.prompt_tokens <= 0 or self.output_tokens <= 0:
            raise ValueError("requests per minute, prompt and output tokens must be positive")

    @property
    def requests_per_s(self) -> float:
        return self.requests_per_minute / 60.0

    @property
    def input_tokens_per_s(self) -> float:
        return self.requests_per_s * self.prompt_tokens

    @property
    def output_tokens_per_s(self) -> float:
        return self.requests_per_s * self.output_tokens


@dataclass(frozen=True)
class PhaseThroughput:
    """Tokens per second one GPU sustains in each phase at the working point."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    source: str = "given"

    def validate(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError("prefill and decode throughputs must be positive")


def mdl_mean_wait(service_s: float, utilization: float) -> float:
    """Mean queueing delay of an M/D/1 queue (Pollaczek-Khinchine, deterministic service)."""
    if utilization >= 1.0:
        return math.inf
    return utilization * service_s / (2.0 * (1.0 - utilization))


def max_utilization_for_ttft(service_s: float, ttft_slo_s: float) -> float:
    """The M/D/1 utilization at which mean TTFT (service + wait) equals the SLO."""
    if service_s >= ttft_slo_s:
        return 0.0
    headroom = 2.0 * (ttft_slo_s - service_s) / service_s
    return headroom / (1.0 + headroom)


def instances_needed(full_load_gpus: float, utilization: float, tp: int) -> int:
    return max(1, math.ceil(full_load_gpus / utilization / tp - 1e-9))


def plan_capacity(
    load: LoadProfile,
    throughput: PhaseThroughput,
    target_utilizations: list[float],
    tp: int = 1,
) -> dict:
    load.validate()
    throughput.validate()
    if not target_utilizations or any(not 0 < u <= 1 for u in target_utilizations):
        raise ValueError("target utilizations must lie in (0, 1]")
    prefill_full = load.input_tokens_per_s / throughput.prefill_tokens_per_s
    decode_full = load.output_tokens_per_s / throughput.decode_tokens_per_s
    at_targets = []
    for u in target_utilizations:
        prefill_instances = instances_needed(prefill_full, u, tp)
        decode_instances = instances_needed(decode_full, u, tp)
        colocated_instances = instances_needed(prefill_full + decode_full, u, tp)
        at_targets.append(
            {
                "target_utilization": u,
                "prefill_instances": prefill_instances,
                "decode_instances": decode_instances,
                "disaggregated_gpus": (prefill_instances + decode_instances) * tp,
                "colocated_instances": colocated_instances,
                "colocated_gpus": colocated_instances * tp,
                "prefill_mean_ttft_ms": prefill_ttft_ms(load, throughput, tp, prefill_instances),
            }
        )
    notes: list[str] = []
    result = {
        "requests_per_s": load.requests_per_s,
        "input_tokens_per_s": load.input_tokens_per_s,
        "output_tokens_per_s": load.output_tokens_per_s,
        "prefill_tokens_per_s_per_gpu": throughput.prefill_tokens_per_s,
        "decode_tokens_per_s_per_gpu": throughput.decode_tokens_per_s,
        "throughput_source": throughput.source,
        "tp": tp,
        "prefill_gpus_at_full_load": prefill_full,
        "decode_gpus_at_full_load": decode_full,
        "colocated_gpus_at_full_load": prefill_full + decode_full,
        "prefill_to_decode_ratio": prefill_full / decode_full,
        "at_target_utilization": at_targets,
        "prefill_service_ms": prefill_service_s(load, throughput, tp) * 1000.0,
        "prefill_max_utilization_for_ttft": None,
        "notes": notes,
    }
    if load.ttft_slo_ms is not None:
        service = prefill_service_s(load, throughput, tp)
        result["prefill_max_utilization_for_ttft"] = max_utilization_for_ttft(
            service, load.ttft_slo_ms / 1000.0
        )
        if service * 1000.0 >= load.ttft_slo_ms:
            notes.append(
                f"one prompt alone takes {service * 1000:.0f} ms to prefill at this throughput, "
                f"above the {load.ttft_slo_ms:g} ms TTFT SLO: raise TP or shorten prompts"
            )
    if load.itl_slo_ms is not None:
        notes.append(
            "the decode throughput is taken to meet the ITL SLO (true when it comes from a "
            "sweep's working point); check it with the simulator otherwise"
        )
    return result


def prefill_service_s(load: LoadProfile, throughput: PhaseThroughput, tp: int) -> float:
    return load.prompt_tokens / (throughput.prefill_tokens_per_s * tp)


def prefill_ttft_ms(
    load: LoadProfile, throughput: PhaseThroughput, tp: int, instances: int
) -> float | None:
    """M/D/1 mean TTFT with arrivals spread evenly over the prefill instances."""
    service = prefill_service_s(load, throughput, tp)
    utilization = load.requests_per_s / instances * service
    if utilization >= 1.0:
        return None
    return (service + mdl_mean_wait(service, utilization)) * 1000.0


def throughput_from_sweep(sweep: dict) -> PhaseThroughput:
    """Per-GPU phase throughputs recorded by `pdserve bench sweep`."""
    capacity = sweep.get("capacity") if isinstance(sweep, dict) else None
    if not capacity:
        raise ValueError("the sweep found no working point, so it has no throughputs")
    prefill = capacity.get("prefill_tokens_per_s_per_gpu")
    decode = capacity.get("decode_tokens_per_s_per_gpu")
    if not prefill or not decode:
        raise ValueError(
            f"the sweep has no per-phase throughputs ({capacity.get('method')}): rerun it with "
            "the prefill probe or with --num-prefill-gpus/--num-decode-gpus"
        )
    return PhaseThroughput(float(prefill), float(decode), f"sweep: {capacity.get('method')}")
