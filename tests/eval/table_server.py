"""A fake OpenAI-compatible server that answers from tables, for `pdserve eval` tests.

Run as `python -m tests.eval.table_server`: it binds 127.0.0.1 on a free port, prints the
port and serves until terminated. Each table is a server of its own under a path prefix:
`PUT /tables/NAME` sets it ({"replies": {prompt: text}, "default": text, "api_key": key})
and `http://127.0.0.1:PORT/NAME` is then an OpenAI base URL whose `/v1/completions` answer
a prompt (and `/v1/chat/completions` the last message's content) from the table.
`GET /tables/NAME/requests` returns the bodies and Authorization headers it received.
"""

from __future__ import annotations

import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.printed_port import serve_printing_port

app = FastAPI()
tables: dict[str, dict] = {}
received: dict[str, list[dict]] = {}


@app.put("/tables/{name}")
async def set_table(name: str, request: Request) -> JSONResponse:
    tables[name] = await request.json()
    received[name] = []
    return JSONResponse({"ok": True})


@app.get("/tables/{name}/requests")
async def requests_of(name: str) -> JSONResponse:
    return JSONResponse(received.get(name, []))


def refused(name: str, request: Request) -> JSONResponse | None:
    if name not in tables:
        return JSONResponse({"error": {"message": f"no table {name}"}}, status_code=404)
    key = tables[name].get("api_key")
    if key and request.headers.get("authorization") != f"Bearer {key}":
        return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
    return None


@app.get("/{name}/v1/models")
async def models(name: str, request: Request) -> JSONResponse:
    if (denied := refused(name, request)) is not None:
        return denied
    return JSONResponse({"object": "list", "data": [{"id": f"{name}-model", "object": "model"}]})


async def answer(name: str, request: Request, chat: bool) -> JSONResponse:
    if (denied := refused(name, request)) is not None:
        return denied
    body = await request.json()
    received[name].append({"body": body, "authorization": request.headers.get("authorization")})
    table = tables[name]
    asked = body["messages"][-1]["content"] if chat else body["prompt"]
    text = table["replies"].get(asked, table.get("default", ""))
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    return JSONResponse({"choices": [{**choice, "finish_reason": "stop"}]})


@app.post("/{name}/v1/completions")
async def completions(name: str, request: Request) -> JSONResponse:
    return await answer(name, request, chat=False)


@app.post("/{name}/v1/chat/completions")
async def chat_completions(name: str, request: Request) -> JSONResponse:
    return await answer(name, request, chat=True)


def main() -> None:
    serve_printing_port(app)


if __name__ == "__main__":
    sys.exit(main())
