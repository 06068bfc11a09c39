"""Per-step latency models fitted from measured step times.

A step's time is modelled as

    seconds = intercept + per_token * batch_tokens + per_pair * attention_pairs

where `batch_tokens` is the number of tokens the step computes (prompt-chunk tokens
for prefill, one per sequence for decode) and `attention_pairs` the query-key pairs
its attention visits: for a chunk of q new tokens after p cached ones, q*p + q(q+1)/2;
for a decode step, the sum of the sequences' context lengths. The intercept carries
the fixed cost of a step (weights read once, launches, scheduling), the token term
the GEMMs, the pair term the attention. Prefill and decode are fitted apart: they
sit in different regimes (compute-bound vs memory-bound).

Fitted by least squares with non-negative coefficients (a negative cost per token
would be an artefact of noisy points, and extrapolates badly).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


def prefill_pairs(new_tokens: int, cached_tokens: int = 0) -> int:
    """Query-key pairs of a causal chunk of `new_tokens` after `cached_tokens`."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) // 2


@dataclass(frozen=True)
class StepSample:
    batch_tokens: int
    attention_pairs: int
    seconds: float


@dataclass(frozen=True)
class StepLatencyModel:
    intercept_s: float
    per_token_s: float = 0.0
    per_pair_s: float = 0.0

    def predict(self, batch_tokens: int, attention_pairs: int) -> float:
        if batch_tokens <= 0:
            return 0.0
        return (
            self.intercept_s + self.per_token_s * batch_tokens + self.per_pair_s * attention_pairs
        )

    def scaled_for_tp(self, tp: int, efficiency: float = 0.9) -> StepLatencyModel:
        """An estimate for TP ranks from a TP=1 model: the work splits across ranks at
        `efficiency` per doubling; the fixed cost per step does not shrink."""
        if tp == 1:
            return self
        speedup = tp * efficiency ** np.log2(tp)
        return StepLatencyModel(
            self.intercept_s, self.per_token_s / speedup, self.per_pair_s / speedup
        )


def fit_latency_model(samples: list[StepSample]) -> StepLatencyModel:
    """Non-negative least squares over (1, batch_tokens, attention_pairs)."""
    if not samples:
        raise ValueError("no step samples to fit")
    features = np.array([[1.0, s.batch_tokens, s.attention_pairs] for s in samples], dtype=float)
    seconds = np.array([s.seconds for s in samples], dtype=float)
    if np.any(seconds < 0) or np.any(features < 0):
        raise ValueError("step samples must have non-negative sizes and times")
    # Scale columns so the solver sees comparable magnitudes (pairs reach 1e9).
    scale = np.maximum(features.max(axis=0), 1.0)
    active = [0, 1, 2]
    coefficients = np.zeros(3)
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active] / scale[active], seconds, rcond=None)
        if np.all(solution >= 0):
            coefficients[:] = 0.0
            coefficients[active] = solution / scale[active]
            break
        # Drop the most negative term and refit without it.
        active.pop(int(np.argmin(solution)))
    return StepLatencyModel(*(float(c) for c in coefficients))


def fit_quality(model: StepLatencyModel, samples: list[StepSample]) -> dict:
    predicted = np.array([model.predict(s.batch_tokens, s.attention_pairs) for s in samples])
    measured = np.array([s.seconds for s in samples])
    relative = np.abs(predicted - measured) / np.maximum(measured, 1e-12)
    residual = float(np.sum((measured - predicted) ** 2))
    total = float(np.sum((measured - measured.mean()) ** 2))
    return {
        "r2": 1.0 - residual / total if total > 0 else 1.0,
        "max_relative_error": float(relative.max()),
        "mean_relative_error": float(relative.mean()),
    }


@dataclass(frozen=True)
class Calibration:
    """Fitted models for one engine configuration (one TP size)."""

    prefill: StepLatencyModel
    decode: StepLatencyModel
    tp: int = 1
    model: str | None = None

    def for_tp(self, tp: int) -> Calibration:
        if tp == self.tp:
            return self
        if self.tp != 1:
            raise ValueError(f"cannot rescale a TP={self.tp} calibration to TP={tp}")
        return Calibration(
            self.prefill.scaled_for_tp(tp), self.decode.scaled_for_tp(tp), tp, self.model
        )

    def to_json(self) -> dict:
        return {
            "tp": self.tp,
            "model": self.model,
            "prefill_model": asdict(self.prefill),
            "decode_model": asdict(self.decode),
        }


def calibration_for(calibrations: dict[int, Calibration], tp: int) -> Calibration:
    """The calibration measured at `tp`, else the TP=1 one rescaled."""
    if tp in calibrations:
        return calibrations[tp]
    if 1 in calibrations:
        return calibrations[1].for_tp(tp)
    raise ValueError(f"no calibration for TP={tp} and none at TP=1 to rescale")


def parse_samples(records: object, where: str) -> list[StepSample]:
    if not isinstance(records, list) or not records:
        raise ValueError(f"{where}: expected a non-empty list of step samples")
    samples = []
    for number, record in enumerate(records, start=1):
        try:
            samples.append(
                StepSample(
                    int(record["batch_tokens"]),
                    int(record["attention_pairs"]),
                    float(record["seconds"]),
                )
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{where}[{number}]: needs batch_tokens, attention_pairs and seconds"
            ) from None
    return samples


def calibration_from_measurements(data: dict, where: str = "calibration") -> Calibration:
    """Fit both phases from `{"prefill": [...], "decode": [...], "tp": 1}`."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    prefill = fit_latency_model(parse_samples(data.get("prefill"), f"{where}: prefill"))
    decode = fit_latency_model(parse_samples(data.get("decode"), f"{where}: decode"))
    return Calibration(prefill, decode, int(data.get("tp", 1)), data.get("model"))


def load_calibration(path: str) -> Calibration:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"calibration file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc.msg})") from None
    return calibration_from_measurements(data, path)
