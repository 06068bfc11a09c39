"""Request arrival processes: when each request of a run is sent.

Inter-arrival gaps follow a gamma distribution with shape `burstiness` and mean
1 / rate. Burstiness 1 is a Poisson process (exponential gaps); below 1 arrivals come
in bursts, above 1 they are more even (the coefficient of variation of the gaps is
1 / sqrt(burstiness)). This is `vllm bench serve`'s `--burstiness`.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(
    count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send times in seconds from the start of the run, one per request, non-decreasing.

    The first request goes at time 0; an infinite rate sends everything at once.
    """
    if count < 0:
        raise ValueError(f"request count must be non-negative, got {count}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be positive or inf, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if count == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(count)
    gaps = inter_arrival_gaps(count - 1, request_rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def inter_arrival_gaps(
    count: int, request_rate: float, burstiness: float, seed: int = 0
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        return np.full(count, 1.0 / request_rate)
    scale = 1.0 / (request_rate * burstiness)
    return rng.gamma(shape=burstiness, scale=scale, size=count)
