"""A client that goes away aborts its request on the instance (streaming or not)."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("idle_after_module")]

LONG = {"prompt": "Tell me a very long story.", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}  # fmt: skip


def generated_tokens(server) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("pdserve:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no generation_tokens_total")


def aborted_requests(server) -> float:
    """vLLM counts a request the client left among its finished ones, as an abort."""
    total = 0.0
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def running_requests(server) -> list[str]:
    return [
        rid
        for found in server.instances().values()
        for rid in found["inspection"]["unfinished_request_ids"]
    ]


def assert_aborted(server, started_tokens: float) -> None:
    deadline = time.monotonic() + 20
    while running_requests(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_requests(server) == []
    settled = generated_tokens(server)
    time.sleep(1.0)
    assert generated_tokens(server) == settled  # nothing is generating any more
    assert settled - started_tokens < LONG["max_tokens"]  # it stopped early


def test_streaming_client_disconnect_aborts(server) -> None:
    before = generated_tokens(server)
    aborted = aborted_requests(server)
    with (
        httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client,
        client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()  # held: a dropped iterator closes the response
        received = 0
        for line in lines:
            received += line.startswith("data: ")
            if received == 3:
                break
        assert len(running_requests(server)) == 1  # it is still running on the instance
    assert_aborted(server, before)
    assert aborted_requests(server) == aborted + 1


def test_non_streaming_client_disconnect_aborts(server) -> None:
    before = generated_tokens(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base_url + "/v1/completions", json=LONG, headers=server.headers, timeout=2.0
        )
    assert_aborted(server, before)


def test_chat_stream_with_n_aborts_every_choice(server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write a long poem."}],
        "max_tokens": 400, "n": 2, "temperature": 1.0, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    before = generated_tokens(server)
    with (
        httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()  # held: a dropped iterator closes the response
        for i, _ in enumerate(lines):
            if i >= 8:
                break
        assert len(running_requests(server)) == 2
    assert_aborted(server, before)
