"""Per-request sampling settings, shaped like vLLM's `SamplingParams`.

A msgspec Struct because it crosses process boundaries (task messages, the P→D
handoff). Validation happens at construction so bad values never reach an instance.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from pdserve.common.structured_output import StructuredOutput

# Above this, `logprobs` would make every step ship a large part of the vocabulary.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range for one token's bias: [-100, 100]

# generation_config.json keys that map onto SamplingParams fields.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_config_defaults(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments from a checkpoint's generation_config.json
    defaults: what a request that leaves a field unset gets (the offline LLM and the
    gateway share this)."""
    return {
        ours: defaults[theirs]
        for theirs, ours in GENERATION_CONFIG_FIELDS.items()
        if theirs in defaults
    }


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    # Logprobs of every prompt token (but the first) with this many top alternatives,
    # computed where the prompt is computed and returned once, with the first token.
    prompt_logprobs: int | None = None
    # Added to these tokens' logits before sampling (not to the logprobs reported, which
    # are the model's raw distribution, as vLLM's default `raw_logprobs`).
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # The output must match this (JSON schema, regex, choice, grammar): sampled under
    # its token mask on every instance the request runs on.
    structured_outputs: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (
                0.0 <= self.temperature <= 100.0,
                f"temperature must be in [0, 100], got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (off) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0.0 < self.repetition_penalty <= 2.0,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (
                all(abs(b) <= MAX_LOGIT_BIAS_VALUE for b in (self.logit_bias or {}).values()),
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                f"{MAX_LOGIT_BIAS_VALUE:g}]",
            ),
            (
                all(isinstance(s, str) and s for s in self.stop),
                "stop must be a list of non-empty strings",
            ),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be non-negative integers",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
