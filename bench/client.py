"""The HTTP side of `pdserve bench`: streamed OpenAI completions, timed per chunk.

Two backends, named as `vllm bench serve` names them: `openai` posts `/v1/completions`,
`openai-chat` posts `/v1/chat/completions` with the prompt as one user message. The key
in `OPENAI_API_KEY`, when set, goes on every request as `Authorization: Bearer`.

Talks to any OpenAI-compatible server (ours, vLLM, SGLang). Every request is bounded by
a timeout and every failure (refused connection, HTTP error status, error event in the
stream, malformed data, timeout) becomes a failed outcome with a one-line reason, so a
run always finishes.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from pdserve.bench.auth import auth_headers
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import RequestOutcome

ERROR_TEXT_LIMIT = 200
BACKENDS = ("openai", "openai-chat")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_TEXT_LIMIT else text[:ERROR_TEXT_LIMIT] + "..."


def describe_exception(exc: BaseException) -> str:
    detail = str(exc) or repr(exc)
    return short(f"{type(exc).__name__}: {detail}")


class CompletionsClient:
    """Sends streamed completion (or chat) requests and times their chunks."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        max_connections: int = 1000,
        extra_body: dict | None = None,
        backend: str = "openai",
        endpoint: str | None = None,
        temperature: float = 0.0,
        api_key: str | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend '{backend}': choose {', '.join(BACKENDS)}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.extra_body = extra_body or {}
        self.backend = backend
        self.endpoint = endpoint or DEFAULT_ENDPOINTS[backend]
        self.temperature = temperature
        self.http = httpx.AsyncClient(
            headers=auth_headers(api_key),
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def list_models(self) -> list[str]:
        response = await self.http.get(f"{self.base_url}/v1/models", timeout=10.0)
        response.raise_for_status()
        return [str(entry["id"]) for entry in response.json().get("data", [])]

    def request_body(self, sample: SampleRequest, model: str | None, ignore_eos: bool) -> dict:
        body: dict = {
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.backend == "openai-chat":
            # As vLLM's chat backend: one user message, max_completion_tokens.
            if not isinstance(sample.prompt, str):
                raise ValueError("the openai-chat backend needs text prompts, not token ids")
            body["messages"] = [{"role": "user", "content": sample.prompt}]
            body["max_completion_tokens"] = sample.expected_output_len
        else:
            body["prompt"] = sample.prompt
            body["max_tokens"] = sample.expected_output_len
        if model:
            body["model"] = model
        if ignore_eos:
            body["ignore_eos"] = True
        return {**body, **self.extra_body}

    async def complete(
        self, sample: SampleRequest, model: str | None, ignore_eos: bool = False
    ) -> RequestOutcome:
        start = time.perf_counter()
        outcome = RequestOutcome(prompt_len=sample.prompt_len, start_time=start)
        body = self.request_body(sample, model, ignore_eos)
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.http.stream(
                    "POST", f"{self.base_url}{self.endpoint}", json=body
                ) as response:
                    if response.status_code != 200:
                        text = (await response.aread()).decode(errors="replace")
                        outcome.error = short(f"HTTP {response.status_code}: {text}")
                        return outcome
                    await self.read_stream(response, outcome, start)
        except TimeoutError:
            outcome.error = f"timed out after {self.timeout_s:g} s"
        except (httpx.HTTPError, OSError) as exc:
            outcome.error = describe_exception(exc)
        if outcome.error:
            outcome.success = False
        return outcome

    async def read_stream(
        self, response: httpx.Response, outcome: RequestOutcome, start: float
    ) -> None:
        """Fill `outcome` from the SSE stream: TTFT, ITLs, tokens, text."""
        last_chunk = end = start
        chunks = 0
        usage: dict = {}
        done = False
        # Read to the end even after [DONE]: a fully read response keeps its connection
        # in the pool, where breaking off would close it and cost a reconnect.
        async for line in response.aiter_lines():
            if done or not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                end = time.perf_counter()
                continue
            now = time.perf_counter()
            try:
                payload = json.loads(data)
            except json.JSONDecodeError:
                outcome.error = short(f"malformed stream data: {data}")
                return
            if not isinstance(payload, dict):
                outcome.error = short(f"malformed stream data: {data}")
                return
            if "error" in payload:
                outcome.error = short(f"error in stream: {json.dumps(payload['error'])}")
                return
            text = chunk_text(payload)
            if text:
                if chunks == 0:
                    outcome.ttft = now - start
                else:
                    outcome.itl.append(now - last_chunk)
                last_chunk = now
                chunks += 1
                outcome.generated_text += text
            if isinstance(payload.get("usage"), dict):
                usage = payload["usage"]
        if chunks == 0:
            outcome.error = "no tokens received"
            return
        outcome.latency = (end if done else time.perf_counter()) - start
        outcome.output_tokens = int(usage.get("completion_tokens") or chunks)
        outcome.prompt_len = int(usage.get("prompt_tokens") or outcome.prompt_len)
        outcome.success = True


def chunk_text(payload: dict) -> str:
    """The text a completions (or chat) chunk carries; '' for usage-only chunks."""
    choices = payload.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def wait_until_ready(base_url: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Block until `/v1/models` answers 200, or raise after `timeout_s` seconds (vLLM's
    `--ready-check-timeout-sec`: a server still loading its model is waited for)."""
    url = f"{base_url.rstrip('/')}/v1/models"
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(headers=auth_headers(), timeout=min(5.0, max(timeout_s, 0.1))) as http:
        while True:
            try:
                status = http.get(url).status_code
                if status == 200:
                    return
                last = f"HTTP {status}"
            except httpx.HTTPError as exc:
                last = describe_exception(exc)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(f"server not ready after {timeout_s:g} s: {url} gave {last}")
            time.sleep(min(poll_s, left))
