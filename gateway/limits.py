"""Size limits on a request's lists and strings, checked before any work is done for it.

Each choice carries its own copy of the sampling parameters to the prefill instance and
on to the decode one, and stop strings are matched per token per choice on the event
loop: without limits, a 30 MB body with `n` choices becomes gigabytes of messages. The
limits are generous for real use and finite (docs/security.md); one exceeded is a 400
naming the field. (`n` is `sampling.MAX_N`, the body `schemas.MAX_BODY_BYTES`, prompts
`prompts.MAX_PROMPTS`.)
"""

from __future__ import annotations

from typing import Any

from pdserve.gateway.errors import bad_request
from pdserve.gateway.sampling import MAX_N
from pdserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's own limit
MAX_MESSAGES = 4096
MAX_CHAT_TEMPLATE_KWARGS = 64
MAX_MODEL_NAME_CHARS = 256
MAX_USER_CHARS = 1024
MAX_METADATA = 16  # OpenAI's own limit
MAX_TOP_K = (1 << 31) - 1
MAX_DETOKENIZE_TOKENS = 1 << 20
MAX_TOKENIZE_TOKENS = 1 << 20  # /tokenize counts past max_model_len, up to this
# Output constraints travel with every choice to P and D, and compile on both.
MAX_CONSTRAINT_CHARS = 64 << 10  # a regex, a grammar (schemas: structured.MAX_SCHEMA_CHARS)
MAX_CHOICES = 1024
MAX_TOOLS = 128


def check_sampling_limits(request: SamplingFields) -> None:
    """Lists and strings within their limits, and integers within range, before use."""
    at_most(request.model, MAX_MODEL_NAME_CHARS, "model", "characters")
    _between(request.n, 1, MAX_N, "n")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    at_most(stop, MAX_STOP_STRINGS, "stop", "strings")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise bad_request(
            f"each stop string has at most {MAX_STOP_STRING_CHARS} characters", "stop"
        )
    at_most(request.stop_token_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids", "token ids")
    at_most(request.cache_salt, MAX_CACHE_SALT_CHARS, "cache_salt", "characters")
    at_most(request.logit_bias, MAX_LOGIT_BIAS, "logit_bias", "entries")
    at_most(request.user, MAX_USER_CHARS, "user", "characters")
    at_most(request.metadata, MAX_METADATA, "metadata", "entries")
    if request.top_k is not None and request.top_k > MAX_TOP_K:
        raise bad_request(f"top_k must be at most {MAX_TOP_K}, got {request.top_k}", "top_k")
    if isinstance(request, CompletionRequest) and request.best_of is not None:
        _between(request.best_of, 1, MAX_N, "best_of")
    if isinstance(request, ChatCompletionRequest):
        at_most(request.messages, MAX_MESSAGES, "messages", "messages")
        kwargs = request.chat_template_kwargs
        at_most(kwargs, MAX_CHAT_TEMPLATE_KWARGS, "chat_template_kwargs", "entries")
        at_most(request.tools, MAX_TOOLS, "tools", "tools")
    _check_constraint_limits(request)


def _check_constraint_limits(request: SamplingFields) -> None:
    structured = request.structured_outputs
    for value, param in (
        (request.guided_regex, "guided_regex"),
        (request.guided_grammar, "guided_grammar"),
        (structured and structured.regex, "structured_outputs"),
        (structured and structured.grammar, "structured_outputs"),
    ):
        at_most(value, MAX_CONSTRAINT_CHARS, param, "characters")
    at_most(request.guided_choice, MAX_CHOICES, "guided_choice", "choices")
    at_most(structured and structured.choice, MAX_CHOICES, "structured_outputs", "choices")
    for choices, param in ((request.guided_choice, "guided_choice"),
                           (structured and structured.choice, "structured_outputs")):  # fmt: skip
        if choices and any(len(c) > MAX_STOP_STRING_CHARS for c in choices):
            raise bad_request(f"each choice has at most {MAX_STOP_STRING_CHARS} characters", param)


def at_most(value: Any, limit: int, param: str, unit: str) -> None:
    if value is not None and len(value) > limit:
        raise bad_request(f"{param} holds at most {limit} {unit}, got {len(value)}", param)


def _between(value: int, low: int, high: int, param: str) -> None:
    if not low <= value <= high:
        raise bad_request(f"{param} must be between {low} and {high}, got {value}", param)
