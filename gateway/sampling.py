"""From an OpenAI request to SamplingParams: defaults, limits and one-line 400s.

Fields the client leaves unset take the checkpoint's generation_config.json defaults
(as the offline LLM does), then SamplingParams' own. `max_tokens` is checked against
the context: prompt plus completion must fit `max_model_len`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.common.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    generation_config_defaults,
)
from pdserve.common.structured_output import StructuredOutput
from pdserve.gateway.errors import bad_request
from pdserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.gateway.structured import structured_output_of, with_whitespace_policy

MAX_N = 128  # choices per request: beyond this one request would occupy a whole server
_INT64 = 1 << 63
_FROM_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_unsupported(request: SamplingFields) -> None:
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if request.best_of not in (None, 1, request.n):
            raise bad_request("best_of other than n is not supported", param="best_of")
    if isinstance(request, ChatCompletionRequest) and request.echo:
        raise bad_request("echo is not supported", param="echo")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if request.stream and request.prompt_logprobs is not None:  # as vLLM: once, in a body
        raise bad_request("prompt_logprobs are not available with stream=true", "prompt_logprobs")


def requested_prompt_logprobs(request: SamplingFields) -> int | None:
    """`prompt_logprobs`, or what a completion's `echo` with `logprobs` needs (the prompt's
    entries carry as many alternatives as the generated ones)."""
    wanted = request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        wanted = max(wanted or 0, request.logprobs)
    return wanted


def logit_bias_of(request: SamplingFields, vocab_size: int | None) -> dict[int, float] | None:
    """`logit_bias` with token ids for keys, each within the vocabulary (when known)."""
    if not request.logit_bias:
        return None
    bias = {}
    for key, value in request.logit_bias.items():
        if not (key.isascii() and key.isdigit()):  # int() would take " 7", "7_0", "-7"
            raise bad_request(f"logit_bias keys are token ids, got {key!r}", "logit_bias")
        # Over 18 digits is past any vocabulary (and int() refuses 4300 and more).
        if len(key) > 18 or (vocab_size is not None and int(key) >= vocab_size):
            raise bad_request(
                f"logit_bias holds token id {key[:20]}, outside the vocabulary of {vocab_size}",
                "logit_bias",
            )
        bias[int(key)] = value
    return bias


def requested_max_tokens(request: SamplingFields) -> int | None:
    # max_completion_tokens replaces the deprecated max_tokens.
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens  # type: ignore[attr-defined]


def requested_logprobs(request: SamplingFields) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        if not request.logprobs:
            return None
        return request.top_logprobs or 0
    return request.logprobs  # type: ignore[attr-defined]


def build_sampling_params(
    request: SamplingFields,
    generation_defaults: Mapping[str, Any],
    max_model_len: int,
    longest_prompt: int,
    constraint: StructuredOutput | None = None,
    max_tokens_cap: int | None = None,
    vocab_size: int | None = None,
    disable_any_whitespace: bool = False,
) -> SamplingParams:
    """SamplingParams for every prompt of the request (the longest decides the limit);
    `constraint`: an output constraint the endpoint adds (a forced tool call);
    `max_tokens_cap`: the tenant's max_tokens_per_request; `vocab_size`: what
    `logit_bias`'s token ids must be below; `disable_any_whitespace`: the server's
    whitespace policy for JSON constraints."""
    check_unsupported(request)
    structured = structured_output_of(request)
    if constraint is not None:
        if structured is not None:
            raise bad_request(
                "a forced tool call constrains the output already: drop the output "
                "constraint or use tool_choice auto or none",
                param="tool_choice",
            )
        structured = constraint
    structured = with_whitespace_policy(structured, disable_any_whitespace, request)
    if not 1 <= request.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {request.n}", param="n")
    if request.seed is not None and not -_INT64 <= request.seed < _INT64:
        raise bad_request("seed must fit in a signed 64-bit integer", param="seed")
    logprobs = requested_logprobs(request)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        name = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        raise bad_request(f"{name} must be between 0 and {MAX_LOGPROBS}, got {logprobs}", name)
    defaults = generation_config_defaults(generation_defaults)
    values: dict[str, Any] = {k: defaults[k] for k in _FROM_DEFAULTS if k in defaults}
    for name in (*_FROM_DEFAULTS, "presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None:
            values[name] = value
    max_tokens = _max_tokens(request, defaults, max_model_len, longest_prompt, max_tokens_cap)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        return SamplingParams(
            **values,
            n=request.n,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=stop,
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=requested_prompt_logprobs(request),
            logit_bias=logit_bias_of(request, vocab_size),
            skip_special_tokens=request.skip_special_tokens,
            structured_outputs=structured,
        )
    except (ValueError, TypeError) as exc:
        # SamplingParams' messages start with the field's name ("top_k must be ..."):
        # name it as the param where the request has such a field.
        first = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param=first if hasattr(request, first) else None) from None


def _max_tokens(
    request: SamplingFields,
    defaults: Mapping[str, Any],
    max_model_len: int,
    prompt_len: int,
    cap: int | None = None,
) -> int:
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens. Please shorten the prompt.",
            param="prompt" if isinstance(request, CompletionRequest) else "messages",
            code="context_length_exceeded",
        )
    wanted = requested_max_tokens(request)
    name = "max_tokens"
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        name = "max_completion_tokens"
    if wanted is None:  # the tenant's cap bounds the default too, as its budget would
        default = defaults.get("max_tokens")
        return min(room, int(default) if default else room, cap or room)
    if wanted == 0 and isinstance(request, CompletionRequest) and request.echo:
        return 1  # the prompt alone: one token is generated and not shown, as vLLM does
    if wanted < 1:
        raise bad_request(f"{name} must be at least 1, got {wanted}", param=name)
    if cap is not None and wanted > cap:
        raise bad_request(
            f"{name} is too large: {wanted}. This key allows at most {cap} completion "
            "tokens per request.",
            param=name,
        )
    if wanted > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} in "
            f"the completion). Please reduce the prompt or {name}.",
            param=name,
            code="context_length_exceeded",
        )
    return wanted
