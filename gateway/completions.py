"""POST /v1/completions: the text completion API, streamed (SSE) or not."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.generation import GenerationRun
from pdserve.gateway.logprobs import TokenText, completion_logprobs
from pdserve.gateway.prompts import completion_prompts
from pdserve.gateway.sampling import build_sampling_params
from pdserve.gateway.schemas import CompletionRequest, decode_body
from pdserve.gateway.state import Gateway
from pdserve.gateway.streaming import SSE_DONE, AbortingStreamingResponse, sse


async def create_completion(request: Request, gateway: Gateway) -> Response:
    body = decode_body(await request.body(), request.headers.get("content-type"), CompletionRequest)
    model = gateway.check_model(body.model)
    card = gateway.require_model_card()
    prompts = completion_prompts(
        body.prompt, gateway.tokenizer, card.vocab_size, body.add_special_tokens
    )
    longest = max(len(p.token_ids) for p in prompts)
    params = build_sampling_params(body, card.generation_defaults, card.max_model_len, longest)
    run = gateway.start_run(f"cmpl-{uuid.uuid4().hex}", prompts, params, body.cache_salt)
    header = {"id": run.request_id, "object": "text_completion", "created": int(time.time()),
              "model": model}  # fmt: skip
    token_text = TokenText(gateway.tokenizer)
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        return AbortingStreamingResponse(
            _stream(run, header, token_text, include_usage, gateway), run.abort
        )
    choices = await gateway.finish_run(request, run)
    return gateway.json(
        {
            **header,
            "choices": [
                {
                    "index": c.index,
                    "text": c.stream.text,
                    "logprobs": None
                    if c.logprobs is None
                    else completion_logprobs(c.logprobs, token_text),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in choices
            ],
            "usage": run.usage(),
        }
    )


async def _stream(run: GenerationRun, header: dict, token_text: TokenText, include_usage: bool,
                  gateway: Gateway):  # fmt: skip
    offsets = [0] * len(run.choices)
    try:
        async for update in run.updates():
            choice = update.choice
            if not (update.text or update.finish_reason or update.logprobs):
                continue
            logprobs = None
            if choice.logprobs is not None:
                logprobs = completion_logprobs(update.logprobs, token_text, offsets[choice.index])
            offsets[choice.index] += len(update.text)
            chunk = {
                **header,
                "choices": [
                    {
                        "index": choice.index,
                        "text": update.text,
                        "logprobs": logprobs,
                        "finish_reason": update.finish_reason,
                        "stop_reason": choice.stop_reason if update.finish_reason else None,
                    }
                ],
            }
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
        if include_usage:
            yield sse({**header, "choices": [], "usage": run.usage()})
    except Exception as exc:  # the stream is under way: report it in the stream, never raise
        yield sse(gateway.stream_error(exc))
    yield SSE_DONE
