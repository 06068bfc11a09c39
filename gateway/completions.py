"""POST /v1/completions: the text completion API, streamed (SSE) or not.

With `echo` each choice starts with its prompt's text and, with `logprobs`, the prompt's
entries (the first token's null) before the generated ones, as OpenAI and vLLM answer it;
with `max_tokens: 0` the prompt alone. vLLM's `prompt_logprobs` come in each choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.auth import tenant_of
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.generation import Choice, ChoiceUpdate
from pdserve.gateway.limits import check_sampling_limits
from pdserve.gateway.logprobs import (
    TokenText,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined_logprobs,
    prompt_logprobs_entries,
)
from pdserve.gateway.prompts import Prompt, completion_prompts
from pdserve.gateway.replies import choice_entry, respond
from pdserve.gateway.schemas import CompletionRequest, read_body
from pdserve.text.tokenizer import Tokenizer


async def create_completion(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, CompletionRequest)
    check_sampling_limits(body)
    model, card = gateway.admit(body.model, tenant_of(request))
    prompts = await completion_prompts(
        body.prompt,
        gateway.offload,
        card.vocab_size,
        body.add_special_tokens,
        card.max_model_len,
    )
    token_text = TokenText(gateway.tokenizer)
    echo = None
    if body.echo:
        echo = await gateway.offload.run(
            lambda: Echo.of(prompts, gateway.tokenizer, token_text, body.max_tokens == 0),
            "detokenizing the prompt",
            "prompt",
        )
    form = CompletionFormat(token_text, prompts, echo, body.prompt_logprobs is not None)
    return await respond(request, gateway, body, model, card, prompts, form)


@dataclass(frozen=True)
class Echo:
    """What `echo` puts in front of each prompt's choices."""

    texts: list[str]  # each prompt's text (token ids decoded with their special tokens)
    hide_output: bool  # max_tokens 0: the prompt alone (one token was generated, unshown)

    @classmethod
    def of(
        cls, prompts: list[Prompt], tokenizer: Tokenizer, token_text: TokenText, hide: bool
    ) -> Echo:
        """Decodes off the event loop, and fills `token_text`'s cache with the prompts'."""
        for prompt in prompts:
            for token_id in prompt.token_ids:
                token_text(token_id)
        texts = [
            p.text if p.text is not None else tokenizer.decode(p.token_ids, False) for p in prompts
        ]
        return cls(texts, hide)


@dataclass
class CompletionFormat:
    """Choices as plain text."""

    token_text: TokenText
    prompts: list[Prompt]
    echo: Echo | None = None
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` in each choice
    # Per choice, how much text was streamed: logprobs' `text_offset` continues from there.
    streamed: dict[int, int] = field(default_factory=dict)
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def opening(self, choice: Choice) -> None:
        return None

    def final(self, choice: Choice) -> dict[str, Any]:
        text, generated = choice.stream.text, choice.logprobs
        logprobs = None
        if self.echo is None:
            if generated is not None:
                logprobs = completion_logprobs(generated, self.token_text)
        else:
            if self.echo.hide_output:
                text, generated = "", [] if generated is not None else None
            text = self.echo.texts[choice.prompt_index] + text
            if generated is not None:
                logprobs = self._after_prompt(choice, generated)
        content: dict[str, Any] = {"text": text}
        if self.prompt_logprobs:
            ids = self.prompts[choice.prompt_index].token_ids
            content["prompt_logprobs"] = prompt_logprobs_entries(
                ids, choice.prompt_logprobs, self.token_text
            )
        return choice_entry(choice, content, logprobs, choice.finish_reason)

    def chunk(self, update: ChoiceUpdate) -> dict[str, Any]:
        choice = update.choice
        text, generated = update.text, update.logprobs
        if self.echo is not None and self.echo.hide_output:
            text, generated = "", []
        prefix, prompt, offset = "", None, self.streamed.get(choice.index, 0)
        if self.echo is not None and choice.index not in self.streamed:
            # The choice's first chunk: its prompt in front.
            prefix = self.echo.texts[choice.prompt_index]
            offset = len(prefix)
            if choice.logprobs is not None:
                prompt = self._prompt_entries(choice)
                offset = _end_of(prompt)
        logprobs = None
        if choice.logprobs is not None:
            logprobs = completion_logprobs(generated, self.token_text, offset)
            if prompt is not None:
                logprobs = joined_logprobs(prompt, logprobs)
        self.streamed[choice.index] = offset + len(text)
        return choice_entry(choice, {"text": prefix + text}, logprobs, update.finish_reason)

    def _after_prompt(self, choice: Choice, generated: list) -> dict:
        """The prompt's logprobs entries, then the generated tokens' from where they end."""
        prompt = self._prompt_entries(choice)
        return joined_logprobs(
            prompt, completion_logprobs(generated, self.token_text, _end_of(prompt))
        )

    def _prompt_entries(self, choice: Choice) -> dict:
        ids = self.prompts[choice.prompt_index].token_ids
        return echoed_prompt_logprobs(ids, choice.prompt_logprobs, self.token_text)

    def body_fields(self, choices: list[Choice]) -> dict[str, Any]:
        return {}


def _end_of(logprobs: dict) -> int:
    """Where the text of a completion logprobs object's tokens ends."""
    if not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
