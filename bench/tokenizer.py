"""Token counting for building datasets: the server's own tokenizer when it has one.

A server that offers vLLM's `/tokenize` endpoint gives exact counts and token ids, so
prompts can be sent as token-id lists of an exact length. Otherwise an approximate
tokenizer (one token per word or punctuation mark) stands in; the results then take
the prompt length from the server's `usage` when it reports one. `--tokenizer PATH`
(vLLM's flag) names a local folder with a `tokenizer.json` to count with instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import httpx

from pdserve.bench.auth import auth_headers

_PIECE = re.compile(r"\w+|[^\w\s]")


class Tokenizer(Protocol):
    exact: bool

    def count(self, text: str) -> int: ...

    def encode(self, text: str) -> list[int]: ...


class ApproximateTokenizer:
    """One token per word or punctuation mark; real tokenizers give somewhat more."""

    exact = False

    def count(self, text: str) -> int:
        return len(_PIECE.findall(text))

    def encode(self, text: str) -> list[int]:
        # Stable pseudo-ids so callers can slice by token; never sent to a server.
        return [sum(piece.encode()) % 50_000 for piece in _PIECE.findall(text)]

    def truncate(self, text: str, num_tokens: int) -> str:
        """The text cut after `num_tokens` approximate tokens."""
        matches = list(_PIECE.finditer(text))
        if len(matches) <= num_tokens:
            return text
        if num_tokens <= 0:
            return ""
        return text[: matches[num_tokens - 1].end()]


class ServerTokenizer:
    """The server's tokenizer through `POST /tokenize` (vLLM's shape)."""

    exact = True

    def __init__(self, base_url: str, model: str | None, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.client = httpx.Client(timeout=timeout_s, headers=auth_headers())

    def encode(self, text: str) -> list[int]:
        body: dict = {"prompt": text, "add_special_tokens": False}
        if self.model:
            body["model"] = self.model
        response = self.client.post(f"{self.base_url}/tokenize", json=body)
        if response.status_code != 200:
            # A ValueError, so the command line says it in one line.
            raise ValueError(f"the server's /tokenize answered HTTP {response.status_code}")
        payload = response.json()
        tokens = payload.get("tokens", payload.get("token_ids"))
        if not isinstance(tokens, list):
            raise ValueError("the server's /tokenize answer has no token list")
        return [int(t) for t in tokens]

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def close(self) -> None:
        self.client.close()


class LocalTokenizer:
    """A `tokenizer.json` read with the `tokenizers` package: exact counts, no server."""

    exact = True

    def __init__(self, path: str) -> None:
        # Only local folders: a benchmark machine may have no hub access, and a silent
        # download would make the counts depend on the network.
        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise ValueError(
                f"--tokenizer {path}: no tokenizer.json there (only local folders are read)"
            )
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tokenizer = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"--tokenizer {path}: cannot read {file.name}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        return len(self.encode(text))


def pick_tokenizer(base_url: str, model: str | None) -> Tokenizer:
    """The server's tokenizer if `/tokenize` answers, else the approximate one."""
    server = ServerTokenizer(base_url, model, timeout_s=10.0)
    try:
        if server.encode("hello world"):
            return server
    except (httpx.HTTPError, ValueError):
        pass
    server.close()
    return ApproximateTokenizer()
