"""Bad input gets a 4xx with an OpenAI-style error body, and the server keeps serving."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import MAX_MODEL_LEN

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("idle_after_module")]

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hi"}]

BAD_COMPLETIONS = [
    ({"model": "gpt-7", "prompt": "x"}, 404, "model"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, None),
    ({"prompt": "x", "top_p": 7}, 400, None),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 10**6}, 400, "n"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [10**7]}, 400, "prompt"),
    ({"prompt": "x", "stop": [""]}, 400, None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"max_tokens": 3}, 400, None),
    # Fields pdserve does not implement are refused by name, never silently dropped.
    ({"prompt": "x", "prediction": {"type": "content"}}, 400, "prediction"),
    ({"prompt": "x", "no_such_field": 1}, 400, "no_such_field"),
    # Output constraints are checked at the gateway, naming the field.
    ({"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "nope"}},
            },
        },
        400,
        "response_format",
    ),
    ({"prompt": "x", "guided_regex": "("}, 400, "guided_regex"),
    ({"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ({"prompt": "x", "guided_json": "{not json"}, 400, "guided_json"),
    ({"prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a"}, 400, "guided_regex"),
    (
        {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "structured_outputs",
    ),
    (
        {"prompt": "x", "structured_outputs": {"regex": "a", "backend": "outlines"}},
        400,
        "structured_outputs",
    ),
    ({"prompt": "x", "guided_choice": ["a"] * 1025}, 400, "guided_choice"),
    ({"prompt": "x", "guided_regex": "a" * 70000}, 400, "guided_regex"),
    ({"prompt": "x", "guided_json": {"enum": ["a" * 70000]}}, 400, "guided_json"),
]
TOOLS = [{"type": "function", "function": {"name": "f"}}]
BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ({"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": CHAT, "model": "nope"}, 404, "model"),
    ({"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    # Tools: a choice this server cannot honour, or a malformed tool, is refused.
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": "auto"}, 400, "tool_choice"),
    ({"messages": CHAT, "tools": TOOLS}, 400, "tool_choice"),  # auto, OpenAI's default
    ({"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": CHAT, "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {}}]}, 400, "tools"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f",
      "parameters": {"type": 3}}}]}, 400, "tools"),
    ({"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, 400, "tool_choice"),
]  # fmt: skip


def assert_openai_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "\n" not in error["message"] and "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(server, body, status, param) -> None:
    assert_openai_error(server.post("/v1/completions", json=body), status, param)


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHATS)
def test_bad_chat_requests(server, body, status, param) -> None:
    assert_openai_error(server.post("/v1/chat/completions", json=body), status, param)


def test_documented_no_op_fields_are_accepted(server) -> None:
    no_ops = {"user": "u-1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    body = {"prompt": "x", "max_tokens": 1, **no_ops}
    assert server.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": CHAT, "max_tokens": 1, "tools": [], "tool_choice": "none", **no_ops}
    assert server.post("/v1/chat/completions", json=chat).status_code == 200


def test_prompt_over_max_model_len(server) -> None:
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    error = assert_openai_error(
        server.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}), 400
    )
    assert error["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in error["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=1
        )


def test_malformed_json_and_wrong_content_type(server) -> None:
    headers = {"Content-Type": "application/json"}
    error = assert_openai_error(
        server.post("/v1/completions", content=b'{"prompt": "x",', headers=headers), 400
    )
    assert "malformed JSON" in error["message"]
    assert_openai_error(server.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
    assert_openai_error(server.post("/v1/completions", content=b"", headers=headers), 400)
    plain = {"Content-Type": "text/plain"}
    assert_openai_error(server.post("/v1/completions", content=b"{}", headers=plain), 415)
    assert_openai_error(server.post("/tokenize", content=b"prompt", headers=plain), 415)


def test_api_key_is_required(server) -> None:
    import httpx

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic test-key"}):
        response = httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "x"}, headers=headers
        )
        assert_openai_error(response, 401)
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="wrong").models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200  # health stays open


def test_unknown_routes_and_methods_answer_in_the_same_shape(server) -> None:
    assert_openai_error(server.get("/v1/nothing-here"), 404)
    assert_openai_error(server.get("/v1/completions"), 405)


def test_the_server_still_serves_after_bad_input(server) -> None:
    client = server.openai()
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert result.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == [MODEL]
