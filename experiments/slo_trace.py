"""The SLO-control trace: chat, RAG, mixed and a burst, a pure function of seed, scale and rate.

Phases follow one another (Poisson arrivals within each):

- chat: 100-300-token prompts, 300-600-token answers, at `rate` requests/s;
- rag: 1800-2200-token prompts (retrieved context), 20-60-token answers;
- mixed: each request chat or RAG with even odds;
- burst: the mixed traffic at twice the mixed phase's rate.

A RAG prompt costs a prefill instance about ten times a chat prompt, so the rag and mixed
phases run at fixed fractions of `rate` (0.17 and 0.3) that offer each phase about the
same work (instance-seconds per second) on a CPU-calibrated latency model: the phases
differ in which pool the work lands on, not in how much there is. `scale` stretches the
phases' lengths (1.0: the full trace; tests take a short one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from the trace's start
    prompt_tokens: int
    output_tokens: int
    phase: str


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float  # at scale 1
    rate_factor: float  # of the trace's rate
    rag_share: float  # the chance a request is a RAG one


CHAT_PROMPT, CHAT_OUTPUT = (100, 300), (300, 600)
RAG_PROMPT, RAG_OUTPUT = (1800, 2200), (20, 60)
MIXED_FACTOR = 0.3
PHASES = (
    Phase("chat", 120.0, 1.0, 0.0),
    Phase("rag", 120.0, 0.17, 1.0),
    Phase("mixed", 120.0, MIXED_FACTOR, 0.5),
    Phase("burst", 30.0, 2 * MIXED_FACTOR, 0.5),
)


def phase_windows(scale: float) -> list[tuple[str, float, float]]:
    """(phase, start, end) in seconds for a trace stretched by `scale`."""
    windows, start = [], 0.0
    for phase in PHASES:
        end = start + phase.seconds * scale
        windows.append((phase.name, start, end))
        start = end
    return windows


def phased_trace(seed: int, scale: float, rate: float) -> list[TraceRequest]:
    """Every request of the trace in arrival order."""
    if scale <= 0 or rate <= 0:
        raise ValueError("scale and rate must be positive")
    rng = np.random.default_rng(seed)
    requests: list[TraceRequest] = []
    for phase, (name, start, end) in zip(PHASES, phase_windows(scale), strict=True):
        phase_rate = rate * phase.rate_factor
        at = start + rng.exponential(1.0 / phase_rate)
        while at < end:
            rag = rng.random() < phase.rag_share
            prompt, output = (RAG_PROMPT, RAG_OUTPUT) if rag else (CHAT_PROMPT, CHAT_OUTPUT)
            requests.append(
                TraceRequest(
                    float(at),
                    int(rng.integers(prompt[0], prompt[1] + 1)),
                    int(rng.integers(output[0], output[1] + 1)),
                    name,
                )
            )
            at += rng.exponential(1.0 / phase_rate)
    return requests
