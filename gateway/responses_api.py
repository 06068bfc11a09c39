"""POST /v1/responses: OpenAI's Responses API, on the chat completions' path.

The body becomes a chat request (`responses_request.py`), which runs as any chat
completion does (template, tools, output constraints, sampling parameters, one choice);
the choice comes back as a response object whose `output` holds an assistant message
and the function calls found in it, or as OpenAI's stream of typed events:
`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` … `.done`,
`response.function_call_arguments.delta` … `.done`, `response.output_item.done`, and
`response.completed` (`response.incomplete` when `max_output_tokens` ran out).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.chat import admit_chat
from pdserve.gateway.errors import APIError
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.generation import ChoiceUpdate, GenerationRun
from pdserve.gateway.limits import MAX_MESSAGES, MAX_TOOLS, at_most
from pdserve.gateway.replies import start_generation
from pdserve.gateway.responses_output import ResponseWriter
from pdserve.gateway.responses_request import (
    RENAMED_PARAMS,
    ResponsesRequest,
    chat_request_of,
)
from pdserve.gateway.schemas import read_body
from pdserve.gateway.streaming import AbortingStreamingResponse


async def create_response(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, ResponsesRequest)
    try:
        return await _respond(request, gateway, body)
    except APIError as exc:  # the chat path's words for fields this API names otherwise
        raise _renamed(exc) from None


async def _respond(request: Request, gateway: Gateway, body: ResponsesRequest) -> Response:
    if isinstance(body.input, list):
        at_most(body.input, MAX_MESSAGES, "input", "items")
    at_most(body.tools, MAX_TOOLS, "tools", "tools")
    chat = chat_request_of(body)
    admitted = await admit_chat(request, gateway, chat)
    tools = admitted.tools
    run = start_generation(
        request, gateway, chat, admitted.card, [admitted.prompt], "resp", tools.constraint
    )
    params = run.params
    writer = ResponseWriter(
        run.request_id, admitted.model, body, tools, params.temperature, params.top_p
    )
    if body.stream:
        return AbortingStreamingResponse(_events(run, writer, gateway), run.abort)
    [choice] = await gateway.finish_run(request, run)
    return gateway.json(writer.finished(choice, run.usage()))


async def _events(
    run: GenerationRun, writer: ResponseWriter, gateway: Gateway
) -> AsyncIterator[bytes]:
    for event in writer.opening():
        yield _sse(event)
    try:
        update: ChoiceUpdate | None = None
        async for update in run.updates():
            for event in writer.feed(update):
                yield _sse(event)
        assert update is not None and update.finish_reason is not None
        for event in writer.closing(update.choice, run.usage()):
            yield _sse(event)
    except Exception as exc:  # the stream is under way: report it in the stream, never raise
        error = gateway.stream_error(exc)["error"]
        yield _sse(
            writer.event(
                "error",
                code=error["code"] or error["type"],
                message=error["message"],
                param=error["param"],
            )
        )


def _sse(event: dict[str, Any]) -> bytes:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {event['type']}\ndata: ".encode() + msgspec.json.encode(event) + b"\n\n"


def _renamed(exc: APIError) -> APIError:
    param = exc.param or ""
    head = param.split(".", 1)[0].split("[", 1)[0]
    if head == "tools":  # the chat API nests a tool's fields under `function`
        return APIError(exc.status, exc.message.replace(".function.", "."), param, exc.code)
    if head not in RENAMED_PARAMS:
        return exc
    new = RENAMED_PARAMS[head] + param[len(head) :]
    message = exc.message.replace(head, RENAMED_PARAMS[head])
    return APIError(exc.status, message, new, exc.code, exc.headers)
