"""Logprobs in the two OpenAI shapes: completions (parallel lists) and chat (content items)."""

from __future__ import annotations

from collections.abc import Sequence

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
    entries = [(token_text(lp.token_id), lp) for lp in logprobs]
    return _entries(entries, token_text, text_offset)


def echoed_prompt_logprobs(
    token_ids: list[int], scored: list[TokenLogprobs | None] | None, token_text: TokenText
) -> dict:
    """The prompt's entries in front of a completion's logprobs under `echo`: one per
    prompt token, the first (and any not scored) null, offsets from 0."""
    scored = scored or []
    entries = [
        (token_text(token_id), scored[i - 1] if 0 < i <= len(scored) else None)
        for i, token_id in enumerate(token_ids)
    ]
    return _entries(entries, token_text, 0)


def _entries(
    entries: Sequence[tuple[str, TokenLogprobs | None]], token_text: TokenText, offset: int
) -> dict:
    """The completions API's logprobs object of (token text, its logprobs or None)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for text, lp in entries:
        tokens.append(text)
        token_logprobs.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else _top_map(lp, text, token_text))
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _top_map(lp: TokenLogprobs, text: str, token_text: TokenText) -> dict[str, float]:
    """{token text: logprob} of the alternatives and the token itself."""
    top = {token_text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
    top.setdefault(text, lp.logprob)
    return top


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two completion logprobs objects one after the other."""
    return {key: first[key] + then[key] for key in first}


def prompt_logprobs_entries(
    token_ids: list[int], scored: list[TokenLogprobs | None] | None, token_text: TokenText
) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first null) {token id: {"logprob",
    "rank", "decoded_token"}} for the token itself and its most likely alternatives."""
    scored = scored or []
    entries: list[dict[str, dict] | None] = [None]
    for i, token_id in enumerate(token_ids[1:]):
        lp = scored[i] if i < len(scored) else None
        if lp is None:
            entries.append(None)
            continue
        entry = {str(token_id): _vllm_logprob(lp.logprob, lp.rank, token_text(token_id))}
        for rank, (other, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True)):
            entry.setdefault(str(other), _vllm_logprob(value, rank + 1, token_text(other)))
        entries.append(entry)
    return entries


def _vllm_logprob(value: float, rank: int, text: str) -> dict:
    return {"logprob": value, "rank": rank, "decoded_token": text}


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
