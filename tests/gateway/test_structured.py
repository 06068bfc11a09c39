"""The whitespace policy of JSON constraints: the server's `--structured-outputs-config`
default, a request's own `structured_outputs.disable_any_whitespace`, and their 400s.
Parsing only; no server."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.cli import build_parser
from pdserve.cluster.deployment import Deployment
from pdserve.cluster.serve import gateway_config
from pdserve.common.structured_output import StructuredOutput
from pdserve.gateway.errors import APIError
from pdserve.gateway.sampling import build_sampling_params
from pdserve.gateway.schemas import ChatCompletionRequest
from pdserve.gateway.structured import check_structured_outputs_config

SCHEMA = {"type": "object", "properties": {"a": {"type": "number"}}}


def _request(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def _spec(request: ChatCompletionRequest, server_compact: bool = False,
          constraint: StructuredOutput | None = None) -> StructuredOutput | None:  # fmt: skip
    params = build_sampling_params(request, {}, 512, 10, constraint,
                                   disable_any_whitespace=server_compact)  # fmt: skip
    return params.structured_outputs


def test_json_answers_have_free_whitespace_unless_the_server_says_otherwise() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    for fields in ({"response_format": schema}, {"response_format": {"type": "json_object"}},
                   {"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}):  # fmt: skip
        assert not _spec(_request(**fields)).disable_any_whitespace
        assert _spec(_request(**fields), server_compact=True).disable_any_whitespace
    forced = StructuredOutput(json='{"type": "object"}')  # a forced tool call's arguments
    assert _spec(_request(), server_compact=True, constraint=forced).disable_any_whitespace
    regex = _spec(_request(guided_regex="[0-9]+"), server_compact=True)
    assert regex == StructuredOutput(regex="[0-9]+")  # whitespace is the pattern's own


def test_a_requests_own_setting_wins_both_ways() -> None:
    compact = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    free = {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}}
    assert _spec(_request(**compact)).disable_any_whitespace
    assert not _spec(_request(**free), server_compact=True).disable_any_whitespace


def test_the_setting_on_a_constraint_without_json_is_a_400() -> None:
    body = {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}
    with pytest.raises(APIError) as caught:
        _spec(_request(**body))
    assert caught.value.status == 400 and caught.value.param == "structured_outputs"
    assert "json and json_object only" in caught.value.message


def test_the_server_flag_takes_vllms_json() -> None:
    args = build_parser().parse_args(
        ["serve", "--structured-outputs-config", '{"disable_any_whitespace": true}']
    )
    deployment = Deployment.from_args(args, cores=[0, 1])
    assert gateway_config(deployment, "model", "127.0.0.1").disable_any_whitespace
    plain = Deployment.from_args(build_parser().parse_args(["serve"]), cores=[0, 1])
    assert not gateway_config(plain, "model", "127.0.0.1").disable_any_whitespace
    assert check_structured_outputs_config('{"backend": "xgrammar"}').backend == "xgrammar"


@pytest.mark.parametrize(
    ("text", "says"),
    [("{not json", "not a JSON object"), ('{"disable_fallback": true}', "disable_fallback"),
     ('{"backend": "outlines"}', "pdserve runs xgrammar"),
     ('{"disable_any_whitespace": "yes"}', "Expected `bool`")],
)  # fmt: skip
def test_a_bad_flag_value_is_one_line(
    text: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--structured-outputs-config", text])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("pdserve serve: error: argument --structured-outputs-config: ")
    assert says in error
