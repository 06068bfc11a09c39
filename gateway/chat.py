"""POST /v1/chat/completions: the chat API, streamed (SSE) or not."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.generation import GenerationRun
from pdserve.gateway.logprobs import TokenText, chat_logprobs
from pdserve.gateway.prompts import chat_prompt
from pdserve.gateway.sampling import build_sampling_params
from pdserve.gateway.schemas import ChatCompletionRequest, decode_body
from pdserve.gateway.state import Gateway
from pdserve.gateway.streaming import SSE_DONE, AbortingStreamingResponse, sse


async def create_chat_completion(request: Request, gateway: Gateway) -> Response:
    body = decode_body(
        await request.body(), request.headers.get("content-type"), ChatCompletionRequest
    )
    model = gateway.check_model(body.model)
    card = gateway.require_model_card()
    prompt = chat_prompt(
        body.messages,
        gateway.tokenizer,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tools=body.tools,
        template_kwargs=body.chat_template_kwargs,
    )
    params = build_sampling_params(
        body, card.generation_defaults, card.max_model_len, len(prompt.token_ids)
    )
    run = gateway.start_run(f"chatcmpl-{uuid.uuid4().hex}", [prompt], params, body.cache_salt)
    header = {"id": run.request_id, "object": "chat.completion", "created": int(time.time()),
              "model": model}  # fmt: skip
    token_text = TokenText(gateway.tokenizer)
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        chunk_header = {**header, "object": "chat.completion.chunk"}
        return AbortingStreamingResponse(
            _stream(run, chunk_header, token_text, include_usage, gateway), run.abort
        )
    choices = await gateway.finish_run(request, run)
    return gateway.json(
        {
            **header,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.stream.text},
                    "logprobs": chat_logprobs(c.logprobs, token_text) if c.logprobs else None,
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
    usage_field = {"usage": None} if include_usage else {}
    try:
        for choice in run.choices:  # the role comes first, as OpenAI sends it
            first = {"index": choice.index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}  # fmt: skip
            yield sse({**header, "choices": [first], **usage_field})
        async for update in run.updates():
            choice = update.choice
            if not (update.text or update.finish_reason or update.logprobs):
                continue
            logprobs = None
            if choice.logprobs is not None:
                logprobs = chat_logprobs(update.logprobs, token_text)
            delta = {"content": update.text} if update.text else {}
            entry = {
                "index": choice.index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": update.finish_reason,
                "stop_reason": choice.stop_reason if update.finish_reason else None,
            }
            yield sse({**header, "choices": [entry], **usage_field})
        if include_usage:
            yield sse({**header, "choices": [], "usage": run.usage()})
    except Exception as exc:  # the stream is under way: report it in the stream, never raise
        yield sse(gateway.stream_error(exc))
    yield SSE_DONE
