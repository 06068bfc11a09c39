"""POST /v1/chat/completions: the chat API, streamed (SSE) or not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.auth import tenant_of
from pdserve.gateway.gateway import Gateway, ModelCard
from pdserve.gateway.generation import Choice, ChoiceUpdate
from pdserve.gateway.limits import check_sampling_limits
from pdserve.gateway.logprobs import TokenText, chat_logprobs, prompt_logprobs_entries
from pdserve.gateway.prompts import Prompt, chat_prompt
from pdserve.gateway.replies import choice_entry, respond
from pdserve.gateway.schemas import ChatCompletionRequest, read_body
from pdserve.gateway.tools import (
    ToolCallStream,
    ToolPlan,
    call_entry,
    calls_in,
    finish_reason_with,
    new_call_id,
    plan_tools,
)


async def create_chat_completion(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    chat = await admit_chat(request, gateway, body)
    scored = chat.prompt if body.prompt_logprobs is not None else None
    form = ChatFormat(TokenText(gateway.tokenizer), chat.tools, scored)
    return await respond(
        request, gateway, body, chat.model, chat.card, [chat.prompt], form, chat.tools.constraint
    )


@dataclass(frozen=True)
class AdmittedChat:
    """A chat request checked, admitted and rendered: what its generation starts from."""

    tools: ToolPlan
    model: str  # the served name
    card: ModelCard
    prompt: Prompt


async def admit_chat(
    request: Request, gateway: Gateway, body: ChatCompletionRequest
) -> AdmittedChat:
    """The chat path's checks in their order, then the rendered prompt (also the
    Responses API's, whose body becomes a chat request)."""
    check_sampling_limits(body)
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, gateway.tool_parser)
    model, card = gateway.admit(body.model, tenant_of(request))
    prompt = await chat_prompt(
        body.messages,
        gateway.offload,
        card.max_model_len,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tools=body.tools,
        template_kwargs=body.chat_template_kwargs,
        trust_request_template=gateway.config.trust_request_chat_template,
    )
    return AdmittedChat(tools, model, card, prompt)


@dataclass
class ChatFormat:
    """Choices as assistant messages, streamed as deltas; tool calls where asked for."""

    token_text: TokenText
    tools: ToolPlan
    scored_prompt: Prompt | None = None  # vLLM's `prompt_logprobs` asked for: of this prompt
    streams: dict[int, ToolCallStream] = field(default_factory=dict)
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self, choice: Choice) -> dict[str, Any]:
        # The role comes first, as OpenAI sends it.
        return {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def final(self, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.stream.text}
        finish_reason = choice.finish_reason
        if self.tools.returns_calls:
            content, calls = calls_in(self.tools, choice.stream.text)
            if calls:
                message["content"] = content
                message["tool_calls"] = [
                    call_entry(i, call, new_call_id()) for i, call in enumerate(calls)
                ]
                for entry in message["tool_calls"]:
                    del entry["index"]  # only streamed deltas carry one
                finish_reason = finish_reason_with(calls, finish_reason)
        logprobs = chat_logprobs(choice.logprobs, self.token_text) if choice.logprobs else None
        return choice_entry(choice, {"message": message}, logprobs, finish_reason)

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        logprobs = None
        if update.choice.logprobs is not None:
            logprobs = chat_logprobs(update.logprobs, self.token_text)
        if not self.tools.returns_calls:
            delta: dict[str, Any] = {"content": update.text} if update.text else {}
            return choice_entry(update.choice, {"delta": delta}, logprobs, update.finish_reason)
        stream = self.streams.setdefault(update.choice.index, ToolCallStream(self.tools))
        finished = update.finish_reason is not None
        content, calls = stream.feed(update.choice.stream.text, update.text, finished)
        delta = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        finish_reason = update.finish_reason
        if finished and stream.ids:
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return choice_entry(update.choice, {"delta": delta}, logprobs, finish_reason)

    def body_fields(self, choices: list[Choice]) -> dict[str, Any]:
        """vLLM's `prompt_logprobs`, beside the choices (one prompt: one list)."""
        if self.scored_prompt is None or not choices:
            return {}
        scored = choices[0].prompt_logprobs
        ids = self.scored_prompt.token_ids
        return {"prompt_logprobs": prompt_logprobs_entries(ids, scored, self.token_text)}
