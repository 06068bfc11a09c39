"""/openapi.json describes the request bodies from their types, with their limits, and a
schemathesis run from it against a real server (the embedded model, colocated) finds no
5xx and no crash. PDSERVE_FUZZ_EXAMPLES sets the cases per operation (more on demand)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from experiments.serving import LOCAL, MODEL, ServeProcess, served
from pdserve.gateway.openapi import openapi_document
from pdserve.gateway.responses_request import ResponsesRequest
from pdserve.gateway.schemas import ChatCompletionRequest, CompletionRequest

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "40"))
SCHEMA = schemathesis.openapi.from_dict(openapi_document())
RESPONSES = "/v1/responses"
STATUSES: Counter[tuple[str, int]] = Counter()  # (path, status) of every fuzzed call


def test_the_document_describes_every_request_field_with_its_limits() -> None:
    document = openapi_document()
    schemas = document["components"]["schemas"]
    for body in (CompletionRequest, ChatCompletionRequest, ResponsesRequest):
        described = set(schemas[body.__name__]["properties"])
        assert described == set(body.__struct_fields__), body.__name__
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == 128
    stop = {a.get("type"): a for a in completion["stop"]["anyOf"]}
    assert stop["array"]["maxItems"] == 32 and stop["array"]["items"]["maxLength"] == 512
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == 4096
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    msgspec.json.encode(document)  # plain JSON


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    # A body that leaves its token limit unset gets 4 tokens, not the whole context: the
    # fuzz is after refusals and crashes, and a /v1/responses body is often valid.
    defaults = tmp_path_factory.mktemp("generation")
    (defaults / "generation_config.json").write_text('{"max_new_tokens": 4}')
    args = (*LOCAL, "--mode", "colocated", "--num-colocated", "1", "--max-model-len", "48",
            "--kv-cache-memory", "64MiB", "--generation-config", str(defaults))  # fmt: skip
    with served(*args) as process:
        yield process
        # No crash: it still serves an ordinary request.
        result = process.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert result.choices[0].text is not None


def _fuzz(examples: int, phases: tuple[Phase, ...] = (Phase.explicit, Phase.generate)):
    return settings(
        max_examples=examples,
        deadline=None,
        phases=list(phases),
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )


def _check(case, server: ServeProcess) -> None:
    response = case.call(base_url=server.base_url, headers=server.headers, timeout=120)
    STATUSES[(case.path, response.status_code)] += 1
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and "Traceback" not in response.text


@pytest.mark.slow
@SCHEMA.exclude(path=RESPONSES).parametrize()
@_fuzz(EXAMPLES)
def test_fuzzed_requests_never_get_a_server_error(case, server) -> None:
    _check(case, server)


@pytest.mark.slow
@SCHEMA.include(path=RESPONSES).parametrize()
@_fuzz(max(1, EXAMPLES // 4), (Phase.generate,))
def test_fuzzed_responses_never_get_a_server_error(case, server) -> None:
    """Fewer cases, generated ones only: most Responses bodies are valid (a string is an
    input), so each case generates, and the schema's explicit variants alone are ~250."""
    _check(case, server)


@pytest.mark.slow
def test_the_fuzz_reached_the_model(server) -> None:
    """Runs after the fuzz (file order): some generated bodies were valid and served,
    or the run above proved nothing about the paths behind validation."""
    if not STATUSES:
        pytest.skip("run together with the fuzz test")
    served = sum(n for (path, status), n in STATUSES.items() if status == 200 and "/v1/" in path)
    assert served > 0, dict(STATUSES)
