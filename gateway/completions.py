"""POST /v1/completions: the text completion API, streamed (SSE) or not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.auth import tenant_of
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.generation import Choice, ChoiceUpdate
from pdserve.gateway.limits import check_sampling_limits
from pdserve.gateway.logprobs import TokenText, completion_logprobs
from pdserve.gateway.prompts import completion_prompts
from pdserve.gateway.replies import choice_entry, respond
from pdserve.gateway.schemas import CompletionRequest, read_body


async def create_completion(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, CompletionRequest)
    check_sampling_limits(body)
    model = gateway.check_model(body.model, tenant_of(request))
    gateway.check_rate(tenant_of(request))  # before the prompt costs any CPU
    card = gateway.require_model_card()
    prompts = await completion_prompts(
        body.prompt, gateway.offload, card.vocab_size, body.add_special_tokens, card.max_model_len
    )
    form = CompletionFormat(TokenText(gateway.tokenizer))
    return await respond(request, gateway, body, model, card, prompts, form)


@dataclass
class CompletionFormat:
    """Choices as plain text."""

    token_text: TokenText
    # Per choice, how much text was streamed: logprobs' `text_offset` continues from there.
    streamed: dict[int, int] = field(default_factory=dict)
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def opening(self, choice: Choice) -> None:
        return None

    def final(self, choice: Choice) -> dict[str, Any]:
        logprobs = None
        if choice.logprobs is not None:
            logprobs = completion_logprobs(choice.logprobs, self.token_text)
        return choice_entry(choice, {"text": choice.stream.text}, logprobs, choice.finish_reason)

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        index = update.choice.index
        offset = self.streamed.get(index, 0)
        logprobs = None
        if update.choice.logprobs is not None:
            logprobs = completion_logprobs(update.logprobs, self.token_text, offset)
        self.streamed[index] = offset + len(update.text)
        return choice_entry(update.choice, {"text": update.text}, logprobs, update.finish_reason)
