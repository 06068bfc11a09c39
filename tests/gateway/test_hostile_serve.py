"""Hostile input against a real `pdserve serve`: a pathological request template (trusted
here) leaves /health answering and SIGTERM working, and at default settings no prompt
reaches the log. The server of this module is its own (it is stopped by SIGTERM)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from experiments import serving
from experiments.serving import ServeProcess
from tests.gateway.conftest import MAX_MODEL_LEN
from tests.gateway.test_hostile_input import NESTED_LOOPS, PLAIN_TEMPLATE

pytestmark = pytest.mark.slow

ARGS = (
    "--mode", "colocated", "--launcher", "local", "--num-colocated", "1",
    "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN),
    "--threads-per-instance", "1", "--log-level", "info", "--trust-request-chat-template",
)  # fmt: skip
SECRET = "marmot-vellum-4417"


@pytest.fixture(scope="module")
def served() -> Iterator[ServeProcess]:
    with serving.served(*ARGS) as process:
        yield process


def full_log(server: ServeProcess) -> str:
    with open(server.log_path) as f:
        return f.read()


def test_no_prompt_in_the_log_at_default_settings(served: ServeProcess) -> None:
    chat = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2}
    assert served.post("/v1/chat/completions", json=chat).status_code == 200
    completion = {"prompt": f"{SECRET} once", "max_tokens": 2, "stream": True}
    assert served.post("/v1/completions", json=completion).status_code == 200
    failing = {"prompt": f"{SECRET} " * 3000, "max_tokens": 1}
    response = served.post("/v1/completions", json=failing)
    assert response.status_code == 400 and SECRET not in response.text
    log = full_log(served)
    assert SECRET not in log, log[-2000:]


def test_a_trusted_request_template_renders_in_its_child(served: ServeProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": PLAIN_TEMPLATE}}  # fmt: skip
    response = served.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(
        served.post("/tokenize", json={"prompt": "<user>Hi", "add_special_tokens": False}).json()[
            "tokens"
        ]
    )


def test_health_answers_and_sigterm_stops_during_a_pathological_render(served) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}],
            "chat_template_kwargs": {"chat_template": NESTED_LOOPS}}  # fmt: skip
    answers: list[object] = []

    def post() -> None:
        try:
            answers.append(served.post("/v1/chat/completions", json=body))
        except httpx.HTTPError as exc:  # the server went away under it: fine here
            answers.append(exc)

    request = threading.Thread(target=post, daemon=True)
    request.start()
    worst = 0.0
    for _ in range(10):
        started = time.monotonic()
        assert served.get("/health").status_code == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.2)
    print(f"worst /health latency during the render: {worst:.3f} s")
    assert worst < 2.0 and request.is_alive()  # the render is still under way
    started = time.monotonic()
    assert served.stop(timeout_s=20) == 0, served.log()
    assert time.monotonic() - started < 20
    request.join(timeout=10)
