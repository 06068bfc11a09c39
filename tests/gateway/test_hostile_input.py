"""Hostile input gets a 400 (or 413) with an OpenAI-style body, never a 500 nor a hung
gateway (docs/security.md). A gateway with a make-believe instance: the
requests here never reach one. Bodies that would pass every check carry `max_tokens: 0`,
the last check before a run starts, so a check that is missing shows as a 400 naming
`max_tokens` instead of the field under test."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from pdserve.gateway import prompts, schemas
from pdserve.gateway.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_CHAT_TEMPLATE_KWARGS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from pdserve.gateway.schemas import MAX_BODY_BYTES
from tests.gateway.hostile import HEAD_TIMEOUT_S, Serving, client_of, close, make_gateway

CHAT = [{"role": "user", "content": "Hi"}]
# Two nested loops of 10^10 steps in all: forever, as far as a request is concerned.
NESTED_LOOPS = (
    "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def client() -> Iterator:
    gateway = make_gateway()
    yield client_of(gateway)
    close(gateway)


@pytest.fixture(scope="module")
def serving() -> Iterator[Serving]:
    """A real HTTP server with the default settings."""
    gateway = make_gateway()
    serving = Serving.start(gateway)
    yield serving
    serving.stop()
    close(gateway)


@pytest.fixture(scope="module")
def trusted() -> Iterator[Serving]:
    """A real HTTP server that takes request templates, with a one-second budget."""
    gateway = make_gateway(trust_request_chat_template=True, cpu_budget_s=1.0)
    serving = Serving.start(gateway)
    yield serving
    serving.stop()
    close(gateway)


def assert_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    return error


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 0, **fields})


def completion(client, **fields):
    return client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0, **fields})


# ---- chat templates ------------------------------------------------------------------------


def test_a_request_may_not_bring_its_own_chat_template(client) -> None:
    kwargs = {"chat_template": NESTED_LOOPS}
    error = assert_error(
        chat(client, chat_template_kwargs=kwargs), 400, "chat_template_kwargs.chat_template"
    )
    assert "--trust-request-chat-template" in error["message"]
    # Naming one of the server's own templates is fine.
    assert_error(chat(client, chat_template_kwargs={"chat_template": "default"}), 400, "max_tokens")


@pytest.mark.parametrize("key", ["tools", "add_generation_prompt", "messages", "raise_exception"])
def test_reserved_template_kwargs_are_400s_naming_the_key(client, key: str) -> None:
    kwargs = {key: [] if key != "add_generation_prompt" else False}
    error = assert_error(
        chat(client, chat_template_kwargs=kwargs), 400, f"chat_template_kwargs.{key}"
    )
    assert key in error["message"]


def test_health_answers_while_a_pathological_template_renders(trusted: Serving) -> None:
    body = {"messages": CHAT, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}}
    answers: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: answers.append(
            httpx.post(trusted.url + "/v1/chat/completions", json=body, timeout=30)
        )
    )
    request.start()
    worst = 0.0
    while request.is_alive():
        started = time.monotonic()
        assert httpx.get(trusted.url + "/health", timeout=5).status_code == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.1)
    print(f"worst /health latency during the render: {worst:.3f} s")
    assert worst < 2.0
    error = assert_error(answers[0], 400, "messages")
    assert error["code"] == "budget_exceeded" and "budget of 1 s" in error["message"]


def test_a_trusted_template_renders_and_a_memory_bomb_fails_in_its_child(trusted) -> None:
    def post(template: str) -> httpx.Response:
        body = {
            "messages": CHAT,
            "max_tokens": 0,
            "chat_template_kwargs": {"chat_template": template},
        }
        return httpx.post(trusted.url + "/v1/chat/completions", json=body, timeout=30)

    assert_error(post(PLAIN_TEMPLATE), 400, "max_tokens")  # rendered; then max_tokens
    error = assert_error(post("{{ 'x' * 10000000000 }}"), 400, "messages")
    assert "MemoryError" in error["message"] or "died" in error["message"]


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(client) -> None:
    started = time.monotonic()
    error = assert_error(completion(client, prompt="word " * 4_000_000), 400, "prompt")
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    assert time.monotonic() - started < 10  # tokenizing 20 MB alone would take longer
    error = assert_error(completion(client, prompt=[1] * 2_000_000), 400, "prompt")
    assert error["code"] == "context_length_exceeded"


def test_token_id_prompts_are_checked_in_a_thread_too(client, monkeypatch) -> None:
    monkeypatch.setattr(prompts, "OFF_LOOP_IDS", 1)  # every token-id prompt goes to a thread
    error = assert_error(completion(client, prompt=[[1, 2], [3, 10**7]]), 400, "prompt")
    assert "outside the vocabulary" in error["message"]
    assert_error(completion(client, prompt=[[1, "a"]]), 400, "prompt")
    assert_error(completion(client, prompt=[[1, 2], [3]]), 400, "max_tokens")


# ---- numbers and limits --------------------------------------------------------------------

OUT_OF_RANGE = [
    ({"top_k": 2**64}, "top_k"),
    ({"top_k": 2**70}, "top_k"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"n": 2**70}, "n"),
    ({"n": -1}, "n"),
    ({"best_of": -1}, "best_of"),
    ({"best_of": 2**70}, "best_of"),
    ({"seed": 2**64}, "seed"),
    # Checked by SamplingParams (after max_tokens, so with a valid one): named all the same.
    ({"min_tokens": 2**70, "max_tokens": 1}, "min_tokens"),
    ({"temperature": -1, "max_tokens": 1}, "temperature"),
    ({"presence_penalty": 1e300, "max_tokens": 1}, "presence_penalty"),
]
TOO_LONG = [
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "s" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
    ({"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"model": "m" * 10_000}, "model"),
]


def test_deeply_nested_json_is_a_400(client) -> None:
    deep = "[" * 5000 + "]" * 5000
    for path, body in [
        ("/v1/completions", f'{{"prompt": {deep}}}'),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "x", "a": {deep}}}]}}',
        ),
        ("/tokenize", f'{{"messages": [{{"role": "user", "content": "x", "a": {deep}}}]}}'),
    ]:
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert "nested too deeply" in assert_error(response, 400, None)["message"]


def test_a_body_of_millions_of_tiny_arrays_is_refused_undecoded(client) -> None:
    # Decoding it would hold the GIL (and the event loop) for seconds.
    many = ",".join(["[]"] * (schemas.MAX_JSON_CONTAINERS + 1))
    body = f'{{"messages": [{{"role": "user", "content": "x", "a": [{many}]}}], "max_tokens": 0}}'
    response = client.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert "arrays and objects" in assert_error(response, 400, None)["message"]


@pytest.mark.parametrize(("fields", "param"), OUT_OF_RANGE + TOO_LONG)
def test_numbers_out_of_range_and_lists_too_long_are_400s(client, fields, param) -> None:
    assert_error(completion(client, **fields), 400, param)


def test_chat_lists_have_limits(client) -> None:
    messages = CHAT * (MAX_MESSAGES + 1)
    assert_error(chat(client, messages=messages), 400, "messages")
    kwargs = {f"k{i}": i for i in range(MAX_CHAT_TEMPLATE_KWARGS + 1)}
    assert_error(chat(client, chat_template_kwargs=kwargs), 400, "chat_template_kwargs")
    assert_error(chat(client, stop=["s"] * (MAX_STOP_STRINGS + 1)), 400, "stop")


# ---- bodies --------------------------------------------------------------------------------


def raw_request(serving: Serving, head: bytes, body_chunks: Iterator[bytes]) -> bytes:
    """Sends the head and the chunks (never ending a chunked body), returns what came back."""
    sock = socket.create_connection((serving.host, serving.port), timeout=20)
    try:
        sock.sendall(head)
        for chunk in body_chunks:
            sock.sendall(chunk)
        answer = b""
        while not _whole(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer
    finally:
        sock.close()


def _whole(answer: bytes) -> bool:
    """Whether the response's head and its Content-Length of body have arrived."""
    head, found, body = answer.partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return True


def test_an_oversized_body_is_refused_before_it_is_read(serving) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1)
    )
    answer = raw_request(serving, head, iter([b'{"prompt": "']))  # the rest never comes
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"type":"invalid_request_error"' in answer


def test_a_chunked_body_is_refused_once_it_passes_the_limit(serving) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = 1 << 20
    chunks = (b"%x\r\n%s\r\n" % (piece, b"a" * piece) for _ in range(MAX_BODY_BYTES // piece + 1))
    answer = raw_request(serving, head, chunks)  # no final 0-chunk: the body never ends
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_body_sent_too_slowly_is_a_408(serving, monkeypatch) -> None:
    monkeypatch.setattr(schemas, "BODY_TIMEOUT_S", 1.0)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    answer = raw_request(serving, head, iter([b'{"prompt": "']))  # the rest never comes
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_slowloris_connections_are_closed(serving) -> None:
    idle = [socket.create_connection((serving.host, serving.port)) for _ in range(500)]
    slow = socket.create_connection((serving.host, serving.port))
    try:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        worst, started = 0.0, time.monotonic()
        while time.monotonic() - started < HEAD_TIMEOUT_S + 1.0:
            with contextlib.suppress(OSError):  # the server may have cut it off already
                slow.sendall(b"X-Drip: 1\r\n")  # a header line at a time, never the end
            asked = time.monotonic()
            assert httpx.get(serving.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - asked)
            time.sleep(0.2)
        print(f"worst /health latency beside 500 idle connections: {worst:.3f} s")
        assert worst < 2.0
        assert closed_by_server(slow)
        assert all(closed_by_server(sock) for sock in idle)
    finally:
        for sock in [*idle, slow]:
            sock.close()


# ---- privacy -------------------------------------------------------------------------------

SECRET = "zebra-quartz-7781"


def test_prompts_are_neither_logged_nor_echoed_unless_asked(client, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    bodies = [
        ("/v1/completions", {"prompt": f"{SECRET} hello", "max_tokens": 0}),
        ("/v1/completions", {"prompt": f"{SECRET} " * 2000, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}], "n": 0}),
        ("/v1/completions", {"prompt": SECRET, "max_tokens": 1, "stop": [SECRET] * 99}),
    ]
    for path, body in bodies:
        response = client.post(path, json=body)
        assert response.status_code == 400 and SECRET not in response.text
    assert SECRET not in caplog.text


def test_enable_log_requests_logs_the_prompt(caplog) -> None:
    gateway = make_gateway(enable_log_requests=True)
    try:
        caplog.set_level(logging.INFO, logger="pdserve.gateway.requests")
        completion(client_of(gateway), prompt=SECRET, max_tokens=0)
        assert SECRET in caplog.text
    finally:
        close(gateway)
