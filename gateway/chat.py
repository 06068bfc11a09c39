"""POST /v1/chat/completions: the chat API, streamed (SSE) or not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.errors import bad_request
from pdserve.gateway.generation import Choice, ChoiceUpdate
from pdserve.gateway.limits import check_sampling_limits
from pdserve.gateway.logprobs import TokenText, chat_logprobs
from pdserve.gateway.prompts import chat_prompt
from pdserve.gateway.responses import choice_entry, respond
from pdserve.gateway.schemas import ChatCompletionRequest, read_body
from pdserve.gateway.state import Gateway


async def create_chat_completion(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    check_sampling_limits(body)
    if body.tools and body.tool_choice != "none":
        # Tool calls are not parsed nor forced yet: free text would be a silent no.
        raise bad_request(
            'tool calling is not supported yet: `tools` are taken only with `tool_choice: "none"`',
            param="tool_choice",
        )
    model = gateway.check_model(body.model)
    card = gateway.require_model_card()
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
    form = ChatFormat(TokenText(gateway.tokenizer))
    return await respond(request, gateway, body, model, card, [prompt], form)


@dataclass
class ChatFormat:
    """Choices as assistant messages, streamed as deltas."""

    token_text: TokenText
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self, choice: Choice) -> dict[str, Any]:
        # The role comes first, as OpenAI sends it.
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}  # fmt: skip

    def final(self, choice: Choice) -> dict[str, Any]:
        message = {"role": "assistant", "content": choice.stream.text}
        logprobs = chat_logprobs(choice.logprobs, self.token_text) if choice.logprobs else None
        return choice_entry(choice, {"message": message}, logprobs, choice.finish_reason)

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        logprobs = None
        if update.choice.logprobs is not None:
            logprobs = chat_logprobs(update.logprobs, self.token_text)
        delta = {"content": update.text} if update.text else {}
        return choice_entry(update.choice, {"delta": delta}, logprobs, update.finish_reason)
