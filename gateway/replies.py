"""What the chat and completions endpoints share: a request's run answered as one JSON body or
as a stream of server-sent chunks, with usage, and failures in OpenAI's shape.

Each endpoint parses its own body and prompts, then hands a `ChoiceFormat` that writes its
choices (a chat message or delta, or a completion's text) to `respond`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from pdserve.common.structured_output import StructuredOutput
from pdserve.gateway.auth import tenant_of
from pdserve.gateway.gateway import Gateway, ModelCard
from pdserve.gateway.generation import Choice, ChoiceUpdate, GenerationRun
from pdserve.gateway.prompts import Prompt, check_vocabulary
from pdserve.gateway.sampling import build_sampling_params
from pdserve.gateway.schemas import SamplingFields
from pdserve.gateway.streaming import SSE_DONE, AbortingStreamingResponse, sse
from pdserve.gateway.timelines import TraceHeaders

# `pdserve serve --enable-log-requests` sets it to INFO; nothing else logs a prompt.
request_log = logging.getLogger("pdserve.gateway.requests")


class ChoiceFormat(Protocol):
    id_prefix: str  # of the response id: "cmpl", "chatcmpl"
    object: str  # the JSON body's `object`
    chunk_object: str  # each chunk's `object`

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        """The choice's entry in a chunk sent with the first token, where the API has one."""
        ...

    def final(self, choice: Choice) -> dict[str, Any]:
        """The finished choice in the JSON body."""
        ...

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        """The update's entry in a chunk."""
        ...

    def body_fields(self, choices: list[Choice]) -> dict[str, Any]:
        """Fields of the JSON body besides the choices and usage (vLLM's extras)."""
        ...


def choice_entry(
    choice: Choice, content: dict[str, Any], logprobs: Any, finish_reason: str | None
) -> dict[str, Any]:
    """One entry of `choices`, in a body or a chunk; `content` holds the API's own fields."""
    return {
        "index": choice.index,
        **content,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": choice.stop_reason if finish_reason else None,
    }


async def respond(
    request: Request,
    gateway: Gateway,
    body: SamplingFields,
    model: str,
    card: ModelCard,
    prompts: list[Prompt],
    form: ChoiceFormat,
    constraint: StructuredOutput | None = None,
) -> Response:
    """`constraint`: an output constraint the endpoint adds (a forced tool call)."""
    run = start_generation(request, gateway, body, card, prompts, form.id_prefix, constraint)
    header = {
        "id": run.request_id,
        "object": form.object,
        "created": int(time.time()),
        "model": model,
    }
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        # vLLM's extension: usage so far on every chunk (with include_usage only, as there).
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        chunk_header = {**header, "object": form.chunk_object}
        chunks = _chunks(run, chunk_header, form, (include_usage, continuous), gateway)
        return AbortingStreamingResponse(chunks, run.abort)
    choices = await gateway.finish_run(request, run)
    return gateway.json(
        {
            **header,
            "choices": [form.final(c) for c in choices],
            "usage": run.usage(),
            **form.body_fields(choices),
        }
    )


def start_generation(
    request: Request,
    gateway: Gateway,
    body: SamplingFields,
    card: ModelCard,
    prompts: list[Prompt],
    id_prefix: str,
    constraint: StructuredOutput | None = None,
) -> GenerationRun:
    """The request's sampling parameters, and its run started under the tenant's limits
    (what every generating endpoint does between its prompts and its reply)."""
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    if gateway.config.enable_log_requests:  # prompts are the clients' data: only when asked
        texts = [p.text if p.text is not None else p.token_ids for p in prompts]
        request_log.info("%s: prompts=%r", request_id, texts)
    longest = max(len(p.token_ids) for p in prompts)
    check_vocabulary(body.stop_token_ids or [], card.vocab_size, "stop_token_ids")
    tenant = tenant_of(request)
    params = build_sampling_params(
        body,
        card.generation_defaults,
        card.max_model_len,
        longest,
        constraint,
        max_tokens_cap=tenant.max_tokens_per_request,
        vocab_size=card.vocab_size,
        disable_any_whitespace=gateway.config.disable_any_whitespace,
    )
    if gateway.config.enable_log_requests:
        request_log.info("%s: params=%r", request_id, params)
    trace = TraceHeaders(
        request.headers.get("traceparent", ""), request.headers.get("tracestate", "")
    )
    received = getattr(request.state, "received_at", None)
    return gateway.start_run(
        request_id, prompts, params, tenant, body.cache_salt, received=received, trace=trace
    )


async def _chunks(
    run: GenerationRun,
    header: dict[str, Any],
    form: ChoiceFormat,
    usage: tuple[bool, bool],
    gateway: Gateway,
) -> AsyncIterator[bytes]:
    """`usage`: (include_usage, continuous_usage_stats)."""
    include_usage, continuous = usage

    def usage_field() -> dict[str, Any]:
        if not include_usage:
            return {}
        return {"usage": run.usage() if continuous else None}

    def openings() -> list[bytes]:
        usage = usage_field()
        if counts := usage.get("usage"):  # as before any token, as vLLM counts its role chunk
            prompt_tokens = counts["prompt_tokens"]
            usage["usage"] = {**counts, "completion_tokens": 0, "total_tokens": prompt_tokens}
        entries = [form.opening(choice) for choice in run.choices]
        return [sse({**header, "choices": [e], **usage}) for e in entries if e is not None]

    try:
        # The openings come with the first token, as vLLM sends them: a client that times
        # its first chunk (`vllm bench serve`) then measures the prefill, not the gateway.
        opened = False
        async for update in run.updates():
            if not opened:
                opened = True
                for chunk in openings():
                    yield chunk
            if update.text or update.finish_reason or update.logprobs:
                yield sse({**header, "choices": [form.chunk(update)], **usage_field()})
        if not opened:
            for chunk in openings():
                yield chunk
        if include_usage:
            yield sse({**header, "choices": [], "usage": run.usage()})
    except Exception as exc:  # the stream is under way: report it in the stream, never raise
        yield sse(gateway.stream_error(exc))
    yield SSE_DONE
