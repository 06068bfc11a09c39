"""Prompts in, token ids out: the shapes a completion accepts, and chat templates.

Tokenizing and rendering happen off the event loop (`gateway/offload.py`). A chat template
comes from the server: the tokenizer's (by name with `chat_template_kwargs.chat_template`
naming one of them) or `--chat-template`; a template the request brings is refused unless
the server runs with `--trust-request-chat-template`, and then renders in a killable child.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pdserve.gateway.errors import bad_request
from pdserve.gateway.offload import Offload

MAX_PROMPTS = 256  # prompts in one completion request
OFF_LOOP_IDS = 4096  # token-id prompts this long are checked in a worker thread
# chat_template_kwargs may not replace what the request's own fields or the renderer set:
# `messages`, `tools` and `add_generation_prompt` come from the request, and the globals
# from the renderer.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "conversation",
        "raise_exception",
        "strftime_now",
        "namespace",
    }
)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None  # None when the client sent token ids


async def completion_prompts(
    prompt: str | list[Any],
    offload: Offload,
    vocab_size: int,
    add_special_tokens: bool,
    max_model_len: int,
) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and _is_token_id(prompt[0]):
        items = [prompt]  # one prompt of token ids (checked below)
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = await offload.encode(item, add_special_tokens, max_model_len, "prompt")
            check_vocabulary(ids, vocab_size, "prompt")
            prompts.append(Prompt(ids, item))
        elif isinstance(item, list) and len(item) > max_model_len:
            # Refused before a scan of the ids on the event loop: it could never fit.
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens, but the "
                f"prompt has {len(item)} tokens. Please shorten the prompt.",
                param="prompt",
                code="context_length_exceeded",
            )
        elif isinstance(item, list):
            if len(item) < OFF_LOOP_IDS:
                _check_token_ids(item, vocab_size)
            else:  # a scan of many ids in Python: in a thread, where the GIL is shared
                check = functools.partial(_check_token_ids, item, vocab_size)
                await offload.run(check, "checking the prompt's token ids", "prompt")
            prompts.append(Prompt(list(item)))
        else:
            raise _bad_shape()
        if not prompts[-1].token_ids:
            raise bad_request("prompt must not be empty", param="prompt")
    return prompts


def _check_token_ids(item: list[Any], vocab_size: int) -> None:
    if not all(_is_token_id(t) for t in item):
        raise _bad_shape()
    check_vocabulary(item, vocab_size, "prompt")


def _bad_shape():
    return bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists",
        param="prompt",
    )


async def chat_prompt(
    messages: list[dict[str, Any]],
    offload: Offload,
    max_model_len: int,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    trust_request_template: bool = False,
) -> Prompt:
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    variables = dict(template_kwargs or {})
    requested = variables.pop("chat_template", None)
    template, from_request = _request_template(requested, offload, trust_request_template)
    _check_template_kwargs(variables)
    conversation = [_flatten_message(m, i) for i, m in enumerate(messages)]
    text = await offload.render(
        conversation,
        template,
        add_generation_prompt,
        tools,
        variables,
        max_model_len,
        from_request,
    )
    if continue_final_message:
        final = conversation[-1].get("content") or ""
        cut = text.rfind(final) if final else -1
        if cut >= 0:
            text = text[: cut + len(final)]
    # The template wrote its own special tokens (bos and the like).
    return Prompt(await offload.encode(text, False, max_model_len, "messages"), text)


def _request_template(value: Any, offload: Offload, trusted: bool) -> tuple[str | None, bool]:
    """`chat_template_kwargs.chat_template` as (template, whether the request brought it):
    None (the server's default), the server's own template of that name, or (trusted
    servers only) a template the request brings."""
    param = "chat_template_kwargs.chat_template"
    if value is None:
        return None, False
    if not isinstance(value, str):
        raise bad_request("chat_template must be a string", param=param)
    named = offload.tokenizer.chat_templates.get(value)
    if named is not None:
        return named, False
    if not trusted:
        raise bad_request(
            "chat templates come from the server: a request may name one of the server's "
            "templates but not bring its own (the server's operator can allow that with "
            "--trust-request-chat-template)",
            param=param,
        )
    return value, True


def _check_template_kwargs(variables: dict[str, Any]) -> None:
    for key in variables:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(
                f"chat_template_kwargs may not set `{key}`: the request's own fields and the "
                "renderer set it",
                param=f"chat_template_kwargs.{key}",
            )
    documents = variables.get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise bad_request(
            "documents must be a list of objects", param="chat_template_kwargs.documents"
        )


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
    if content is None and role == "assistant":
        # OpenAI's API lets an assistant turn of tool calls leave its text out (the
        # Agents SDK and LangChain send null); templates read it as a string, as vLLM does.
        return {**message, "content": ""}
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
