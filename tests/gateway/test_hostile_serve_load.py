"""Hostile bodies against a real `pdserve serve` (the embedded model, colocated): bytes that
are not UTF-8 and strings JSON cannot carry are 400s; the longest stop lists the limits
allow, with the most choices, are served while /health keeps answering within 2 s; a
normal request still succeeds afterwards."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from experiments.serving import LOCAL, MODEL, ServeProcess, served

pytestmark = pytest.mark.slow

ARGS = (*LOCAL, "--mode", "colocated", "--num-colocated", "1", "--max-model-len", "256",
        "--kv-cache-memory", "128MiB")  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with served(*ARGS, clean=True) as process:
        yield process
        result = process.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert result.choices[0].text is not None


def _post_raw(server: ServeProcess, body: bytes) -> httpx.Response:
    headers = {**server.headers, "Content-Type": "application/json"}
    return httpx.post(f"{server.base_url}/v1/completions", content=body, headers=headers,
                      timeout=30)  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": "\xff\xfe bad bytes", "max_tokens": 2}',
        b'{"model": "m", "prompt": "\xc3\x28", "max_tokens": 2}',
        b'{"model": "m", "prompt": "a lone surrogate \\ud800", "max_tokens": 2}',
        b'{"model": "m", "prompt": "x", "stop": ["\\udfff"], "max_tokens": 2}',
    ],
    ids=["invalid-utf8", "overlong", "lone-surrogate", "surrogate-stop"],
)
def test_text_that_is_not_unicode_is_a_400(server, body: bytes) -> None:
    response = _post_raw(server, body.replace(b'"m"', f'"{MODEL}"'.encode()))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_the_largest_stop_lists_with_the_most_choices_leave_health_answering(server) -> None:
    stop = [f"{i:03d}" + "z" * 509 for i in range(32)]  # 32 strings of 512 characters
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "n": 128, "max_tokens": 4,
            "stop": stop, "temperature": 1.0}  # fmt: skip
    statuses: list[int] = []

    def send() -> None:
        response = httpx.post(f"{server.base_url}/v1/completions", json=body,
                              headers=server.headers, timeout=120)  # fmt: skip
        statuses.append(response.status_code)

    senders = [threading.Thread(target=send) for _ in range(2)]
    for sender in senders:
        sender.start()
    worst = 0.0
    while any(s.is_alive() for s in senders):
        asked = time.monotonic()
        assert server.get("/health").status_code == 200
        worst = max(worst, time.monotonic() - asked)
        time.sleep(0.1)
    print(f"worst /health latency under 2 x 128 choices x 32 long stop strings: {worst:.3f} s")
    assert statuses == [200, 200]
    assert worst < 2.0
