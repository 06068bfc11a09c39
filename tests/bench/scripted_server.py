"""A scripted OpenAI-compatible server with known latencies, for benchmark tests.

Run as `python -m tests.bench.scripted_server [--port N] [--script JSON]`: it binds
127.0.0.1 on port N (a free one by default), prints the port on stdout, and serves
until terminated, with the script given or the default one. `POST /script` sets its
behaviour (latencies, which may grow with the number of requests in flight, error
statuses, /tokenize on or off, preemptions above a concurrency) and resets its
counters; `GET /stats` returns what it served. With an `api_key` scripted, every
OpenAI route and `/metrics` answer 401 to a request without `Authorization: Bearer KEY`
(`/v1/*` as with vLLM's `--api-key`; `/metrics` too, as a guarding proxy would, so
the scrape's key is tested); `/script` and `/stats` stay open for the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.printed_port import serve_printing_port

MODEL = "scripted-model"


@dataclass
class Script:
    ttft_s: float = 0.2
    itl_s: float = 0.02
    # Added per other request in flight: latency that grows with load.
    ttft_per_active_s: float = 0.0
    itl_per_active_s: float = 0.0
    status: int = 200  # anything else: every completion answers this status
    tokenize: bool = True
    usage: bool = True
    kv_capacity: int = 64  # requests in flight that fill the KV cache
    preempt_above: int = 0  # >0: a request arriving above this many in flight preempts
    api_key: str = ""  # non-empty: OpenAI routes and /metrics need this bearer key
    models_status: int = 200  # /v1/models answers this (503: "still loading")


@dataclass
class Stats:
    requests: int = 0
    completed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_active: int = 0
    preemptions: int = 0
    unauthorized: int = 0  # requests refused for a missing or wrong API key
    chat_requests: int = 0
    last_body: dict | None = None  # the last completion or chat request body


app = FastAPI()
state = {"script": Script(), "stats": Stats(), "active": 0}


def word_id(word: str) -> int:
    return 100 + sum(word.encode()) % 900


def count_prompt(prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def refused(request: Request) -> JSONResponse | None:
    """A 401 when an API key is scripted and the request does not carry it."""
    key = state["script"].api_key
    if not key or request.headers.get("authorization") == f"Bearer {key}":
        return None
    state["stats"].unauthorized += 1
    error = {"message": "Incorrect API key provided.", "code": "invalid_api_key"}
    return JSONResponse({"error": error}, status_code=401)


@app.post("/script")
async def set_script(request: Request) -> JSONResponse:
    state["script"] = Script(**(await request.json()))
    state["stats"] = Stats()
    return JSONResponse({"ok": True})


@app.get("/stats")
async def get_stats() -> JSONResponse:
    return JSONResponse(asdict(state["stats"]))


@app.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    if (denied := refused(request)) is not None:
        return denied
    if state["script"].models_status != 200:
        return JSONResponse({"error": "loading"}, status_code=state["script"].models_status)
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


@app.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    if (denied := refused(request)) is not None:
        return denied
    if not state["script"].tokenize:
        return JSONResponse({"error": "not found"}, status_code=404)
    prompt = (await request.json())["prompt"]
    tokens = [word_id(w) for w in prompt.split()]
    return JSONResponse({"tokens": tokens, "count": len(tokens)})


@app.get("/metrics")
async def metrics(request: Request) -> Response:
    if (denied := refused(request)) is not None:
        return denied
    script, stats = state["script"], state["stats"]
    usage = min(1.0, state["active"] / script.kv_capacity)
    text = (
        "# TYPE pdserve:kv_cache_usage_perc gauge\n"
        f'pdserve:kv_cache_usage_perc{{role="decode",instance="0"}} {usage}\n'
        "# TYPE pdserve:num_preemptions counter\n"
        f'pdserve:num_preemptions_total{{role="decode",instance="0"}} {stats.preemptions}\n'
    )
    return PlainTextResponse(text)


@app.post("/v1/completions")
async def completions(request: Request):
    return await generate(request, chat=False)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await generate(request, chat=True)


def chat_prompt(body: dict) -> str:
    return " ".join(str(m.get("content", "")) for m in body.get("messages", []))


async def generate(request: Request, chat: bool):
    arrived = asyncio.get_running_loop().time()
    script, stats = state["script"], state["stats"]
    if (denied := refused(request)) is not None:
        return denied
    body = await request.json()
    stats.requests += 1
    stats.chat_requests += chat
    stats.last_body = body
    if script.status != 200:
        return JSONResponse({"error": {"message": "scripted failure"}}, status_code=script.status)
    prompt_tokens = count_prompt(chat_prompt(body) if chat else body["prompt"])
    max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
    state["active"] += 1
    stats.max_active = max(stats.max_active, state["active"])
    if script.preempt_above and state["active"] > script.preempt_above:
        stats.preemptions += 1
    ttft = script.ttft_s + script.ttft_per_active_s * (state["active"] - 1)

    def chunk(text: str, finish: str | None = None) -> str:
        if chat:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
            obj = "text_completion"
        return "data: " + json.dumps({"id": "c", "object": obj, "choices": [choice]})

    async def stream():
        # Tokens are paced against deadlines, not by chained sleeps, so a late wake-up
        # on a busy machine does not push every later token back.
        loop = asyncio.get_running_loop()
        deadline = arrived + ttft
        try:
            for i in range(max_tokens):
                if i > 0:
                    deadline += script.itl_s + script.itl_per_active_s * (state["active"] - 1)
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                finish = "length" if i == max_tokens - 1 else None
                yield chunk(" tok", finish) + "\n\n"
            if script.usage:
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": max_tokens,
                    "total_tokens": prompt_tokens + max_tokens,
                }
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
            stats.completed += 1
            stats.prompt_tokens += prompt_tokens
            stats.completion_tokens += max_tokens
        finally:
            state["active"] -= 1

    return StreamingResponse(stream(), media_type="text/event-stream")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.scripted_server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--script", type=json.loads, default={}, help="a Script as JSON")
    args = parser.parse_args()
    state["script"] = Script(**args.script)
    serve_printing_port(app, args.port)


if __name__ == "__main__":
    sys.exit(main())
