"""Prompts in, token ids out: the shapes a completion accepts, and chat templates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.gateway.errors import bad_request
from pdserve.text.tokenizer import Tokenizer, TokenizerError

MAX_PROMPTS = 256  # prompts in one completion request


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None  # None when the client sent token ids


def completion_prompts(
    prompt: str | list[Any], tokenizer: Tokenizer, vocab_size: int, add_special_tokens: bool
) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(_is_token_id(t) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=add_special_tokens)
            prompts.append(Prompt(ids, item))
        elif isinstance(item, list) and all(_is_token_id(t) for t in item):
            prompts.append(Prompt(list(item)))
        else:
            raise bad_request(
                "prompt must be a string, a list of strings, a list of token ids or a list "
                "of token-id lists",
                param="prompt",
            )
        if not prompts[-1].token_ids:
            raise bad_request("prompt must not be empty", param="prompt")
        check_vocabulary(prompts[-1].token_ids, vocab_size, "prompt")
    return prompts


def chat_prompt(
    messages: list[dict[str, Any]],
    tokenizer: Tokenizer,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> Prompt:
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    conversation = [_flatten_message(m, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **(template_kwargs or {}),
        )
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None
    if continue_final_message:
        final = conversation[-1].get("content") or ""
        cut = text.rfind(final) if final else -1
        if cut >= 0:
            text = text[: cut + len(final)]
    # The template wrote its own special tokens (bos and the like).
    return Prompt(tokenizer.encode(text, add_special_tokens=False), text)


def check_vocabulary(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab_size})", param)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flatten_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI content parts → plain text, which is what text-only templates expect."""
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request(f"messages[{index}] needs a role", param=f"messages[{index}].role")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise bad_request(
            f"messages[{index}].content must be a string or a list of parts",
            param=f"messages[{index}].content",
        )
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"messages[{index}]: content part of type {kind!r} is not supported (text only)",
                param=f"messages[{index}].content",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{index}]: a text part needs a string 'text'")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}
