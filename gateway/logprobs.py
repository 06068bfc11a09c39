"""Logprobs in the two OpenAI shapes: completions (parallel lists) and chat (content items)."""

from __future__ import annotations

from pdserve.common.messages import TokenLogprobs
from pdserve.text.tokenizer import Tokenizer


class TokenText:
    """Each token's own text, decoded once per id (specials shown as themselves)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 100_000:
                self._cache[token_id] = text
        return text


def completion_logprobs(
    logprobs: list[TokenLogprobs], token_text: TokenText, text_offset: int = 0
) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for these tokens;
    `text_offset` is where the first of them starts in the choice's text."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top = {token_text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
        top.setdefault(text, lp.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: list[TokenLogprobs], token_text: TokenText) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}"""
    content = []
    for lp in logprobs:
        text = token_text(lp.token_id)
        content.append(
            {
                "token": text,
                "logprob": lp.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := token_text(i)), "logprob": v, "bytes": list(t.encode())}
                    for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
                ],
            }
        )
    return {"content": content}
