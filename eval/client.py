"""One OpenAI-compatible server as `pdserve eval compare` asks it: greedy, seeded, one
item at a time, non-streamed.

Every failure of a request (refused connection, HTTP error status, malformed body,
timeout) becomes a `Reply` with an error, never an exception, so a run always finishes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from pdserve.bench.auth import auth_headers
from pdserve.bench.client import describe_exception, short
from pdserve.eval.items import EvalItem


@dataclass(frozen=True)
class Reply:
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


class EvalClient:
    """Sends items to one server at temperature 0 with a fixed seed."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_concurrency: int = 8,
        seed: int = 0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.seed = seed
        self.slots = asyncio.Semaphore(max_concurrency)
        self.http = httpx.AsyncClient(
            headers=auth_headers(api_key),
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(max_connections=max_concurrency),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def first_model(self) -> str:
        """The first entry of `/v1/models`; a `ValueError` saying why when there is none."""
        url = f"{self.base_url}/v1/models"
        try:
            response = await self.http.get(url, timeout=min(10.0, self.timeout_s))
            response.raise_for_status()
            models = response.json().get("data") or []
            return str(models[0]["id"])
        except (httpx.HTTPError, OSError) as exc:
            raise ValueError(f"{url}: {describe_exception(exc)}") from None
        except (ValueError, LookupError, TypeError, AttributeError):
            raise ValueError(f"{url} lists no model: pass its name") from None

    def body(self, item: EvalItem, model: str) -> tuple[str, dict]:
        """The route and the JSON body that ask for `item`."""
        body: dict = {
            "model": model,
            "temperature": 0.0,
            "seed": self.seed,
            "max_tokens": item.max_tokens,
        }
        if item.stop:
            body["stop"] = list(item.stop)
        if item.messages is not None:
            return "/v1/chat/completions", {**body, "messages": item.messages}
        return "/v1/completions", {**body, "prompt": item.prompt}

    async def ask(self, item: EvalItem, model: str) -> Reply:
        route, body = self.body(item, model)
        async with self.slots:
            try:
                async with asyncio.timeout(self.timeout_s):
                    response = await self.http.post(f"{self.base_url}{route}", json=body)
            except TimeoutError:
                return Reply(error=f"timed out after {self.timeout_s:g} s")
            except (httpx.HTTPError, OSError) as exc:
                return Reply(error=describe_exception(exc))
        if response.status_code != 200:
            return Reply(error=short(f"HTTP {response.status_code}: {response.text}"))
        return reply_of(response, chat=item.messages is not None)


def reply_of(response: httpx.Response, chat: bool) -> Reply:
    """The first choice's text and finish reason, or an error naming what was wrong."""
    try:
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (ValueError, LookupError, TypeError):
        return Reply(error=short(f"malformed reply: {response.text}"))
    if chat and text is None:  # a chat reply with no content (a tool call) says nothing
        text = ""
    if not isinstance(text, str):
        return Reply(error=short(f"malformed reply: {response.text}"))
    return Reply(text=text, finish_reason=choice.get("finish_reason"))
