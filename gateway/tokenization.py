"""POST /tokenize and /detokenize, in vLLM's shapes (bench and clients count tokens here)."""

from __future__ import annotations

from typing import cast

from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.auth import tenant_of
from pdserve.gateway.errors import bad_request
from pdserve.gateway.gateway import Gateway
from pdserve.gateway.limits import MAX_DETOKENIZE_TOKENS, MAX_MESSAGES, MAX_TOKENIZE_TOKENS, at_most
from pdserve.gateway.logprobs import TokenText
from pdserve.gateway.prompts import chat_prompt, check_vocabulary
from pdserve.gateway.schemas import DetokenizeRequest, TokenizeRequest, read_body


async def tokenize(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, TokenizeRequest)
    gateway.check_model(body.model, tenant_of(request))
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    # Counting is allowed past max_model_len (clients count what they will cut), not forever.
    if body.messages is not None:
        at_most(body.messages, MAX_MESSAGES, "messages", "messages")
        prompt = await chat_prompt(
            body.messages,
            gateway.offload,
            MAX_TOKENIZE_TOKENS,
            add_generation_prompt=body.add_generation_prompt,
        )
        ids = prompt.token_ids
    else:
        text = cast(str, body.prompt)  # exactly one of the two, checked above
        ids = await gateway.offload.encode(
            text, body.add_special_tokens, MAX_TOKENIZE_TOKENS, "prompt"
        )
    card = gateway.model_card
    token_strs = None
    if body.return_token_strs:
        token_text = TokenText(gateway.tokenizer)  # one cache for the whole prompt
        token_strs = [token_text(t) for t in ids]
    payload = {
        "count": len(ids),
        "max_model_len": card.max_model_len if card else None,
        "tokens": ids,
        "token_strs": token_strs,
    }
    return gateway.json(payload)


async def detokenize(request: Request, gateway: Gateway) -> Response:
    body = await read_body(request, DetokenizeRequest)
    gateway.check_model(body.model, tenant_of(request))
    at_most(body.tokens, MAX_DETOKENIZE_TOKENS, "tokens", "token ids")
    check_vocabulary(body.tokens, gateway.tokenizer.vocab_size, "tokens")
    text = await gateway.offload.run(
        lambda: gateway.tokenizer.decode(body.tokens), "detokenizing", "tokens"
    )
    return gateway.json({"prompt": text})
