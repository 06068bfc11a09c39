"""Request bodies of the OpenAI API (and vLLM's extras), decoded strictly with msgspec.

A completion or chat request may hold only the fields below (docs/serving.md, "Request fields"):
one pdserve does not implement is a 400 naming it, never silently dropped. `user`,
`store`, `metadata` and `service_tier`, which SDKs send, are accepted and do nothing. A
field of the wrong type is an error naming the field: "Expected `int`, got `str` - at
`$.max_tokens`". Semantic checks (ranges, combinations) happen when the request is
turned into SamplingParams (`pdserve.gateway.sampling`).
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from pdserve.gateway.errors import APIError, bad_request
from pdserve.gateway.structured import ResponseFormat, StructuredOutputsField

MAX_BODY_BYTES = 32 << 20
BODY_TIMEOUT_S = 60.0  # to receive a whole body, however slowly the client sends it
# msgspec decodes holding the GIL, at up to ~0.3 µs per array or object: 32 MiB of `[],`
# would stall the event loop for seconds. Brackets are counted first (bytes.count, ~10 ms),
# those inside strings too, so a prompt of over a million brackets is refused as well.
MAX_JSON_CONTAINERS = 1 << 20


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields the completion and chat requests share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored, as documented: they describe the caller, not the generation.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # Output constraints, one at most (pdserve.gateway.structured)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists;
    # msgspec unions hold one array type, so the shape is checked in gateway.prompts.
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


T = TypeVar("T")


async def read_body(request: Request, schema: type[T]) -> T:
    """The request's body as `schema` (see `decode_body`)."""
    return decode_body(await read_limited(request), request.headers.get("content-type"), schema)


async def read_limited(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, refused (413) as soon as it passes `limit`: a declared Content-Length over
    it before a byte is read, a chunked body (no length) at the chunk that crosses it, so
    memory never holds more than the limit. A body still arriving after BODY_TIMEOUT_S
    (a client sending it a byte at a time) is a 408."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body took over {BODY_TIMEOUT_S:g} s to arrive") from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def decode_body(body: bytes, content_type: str | None, schema: type[T]) -> T:
    """The request body as `schema`, or an APIError saying what is wrong with it."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(
            415, f"Content-Type must be application/json, got {content_type or 'none'!r}"
        )
    if len(body) > MAX_BODY_BYTES:
        raise _too_large(MAX_BODY_BYTES)
    if not body.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    if body.count(b"[") + body.count(b"{") > MAX_JSON_CONTAINERS:
        raise bad_request(
            f"the request body holds over {MAX_JSON_CONTAINERS} JSON arrays and objects "
            "(`[` and `{`, in strings too)"
        )
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        unknown = _unknown_field(str(exc))
        if unknown is not None:
            raise bad_request(
                f"unsupported field `{unknown}`: pdserve does not implement it "
                "(docs/serving.md lists the request fields it takes)",
                param=unknown,
            ) from None
        raise bad_request(f"invalid request: {exc}", param=_param_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"malformed JSON: {exc}") from None
    except RecursionError:  # msgspec stops near 1000 levels of nesting
        raise bad_request("the request body's JSON is nested too deeply") from None


def _unknown_field(message: str) -> str | None:
    """msgspec's "Object contains unknown field `x`" (top level only) → "x"."""
    marker = "Object contains unknown field `"
    if not message.startswith(marker) or " - at `$." in message:
        return None
    return message[len(marker) :].split("`", 1)[0]


def _param_of(message: str) -> str | None:
    """`$.max_tokens` in msgspec's message → "max_tokens"."""
    marker = "at `$."
    start = message.find(marker)
    if start < 0:
        return None
    rest = message[start + len(marker) :]
    end = rest.find("`")
    return rest[:end] if end >= 0 else None
