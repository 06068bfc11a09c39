"""A request's output constraint, from whichever field the client used to say it.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
object and its older `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` fields
all become one `StructuredOutput`, checked here so that a bad schema or pattern is a 400
naming the field, not a failure on an instance. The instances compile and enforce it
(xgrammar needs torch; the gateway has neither).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import msgspec

from pdserve.common.structured_output import StructuredOutput
from pdserve.gateway.errors import bad_request

# What `structured_outputs`/`guided_decoding_backend` may name: the one engine there is.
BACKENDS = ("auto", "xgrammar")
# A schema travels with every choice to P and D and compiles on both.
MAX_SCHEMA_CHARS = 64 << 10


class JSONSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # text | json_object | json_schema
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    # JSON only: compact separators (None: the server's --structured-outputs-config)
    disable_any_whitespace: bool | None = None


class StructuredOutputsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`pdserve serve --structured-outputs-config '{...}'`: vLLM's flag, the keys that
    apply to the one engine there is."""

    backend: str = "auto"
    disable_any_whitespace: bool = False


def check_json_schema(schema: Any, what: str, param: str | None = None) -> str:
    """The schema as JSON text, once it is a valid JSON schema (jsonschema's meta-schema);
    `what` names it in the message, `param` (default: `what`) in the error's param."""
    param = param or what
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{what} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{what} must be a JSON schema object", param=param)
    try:
        # A bool is a schema too (true: anything); the stubs allow dicts only.
        jsonschema.validators.validator_for(schema).check_schema(schema)  # type: ignore[arg-type]
    except jsonschema.SchemaError as exc:
        raise bad_request(f"{what} is not a valid JSON schema: {exc.message}", param) from None
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise bad_request(f"{what} holds at most {MAX_SCHEMA_CHARS} characters", param)
    return text


def _regex(pattern: str, param: str) -> StructuredOutput:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise bad_request(f"{param} is not a valid regular expression: {exc}", param) from None
    return StructuredOutput(regex=pattern)


def _choice(choices: list[str], param: str) -> StructuredOutput:
    if not choices or not all(choices):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return StructuredOutput(choice=tuple(choices))


def _grammar(grammar: str, param: str) -> StructuredOutput:
    if not grammar.strip():
        raise bad_request(f"{param} is empty", param=param)
    return StructuredOutput(grammar=grammar)


def _from_response_format(value: ResponseFormat) -> StructuredOutput | None:
    if value.type == "text":
        return None
    if value.type == "json_object":
        return StructuredOutput(json_object=True)
    if value.type == "json_schema":
        if value.json_schema is None or value.json_schema.schema is None:
            raise bad_request(
                "response_format json_schema needs `json_schema.schema`", "response_format"
            )
        schema = check_json_schema(value.json_schema.schema, "response_format")
        return StructuredOutput(json=schema)
    raise bad_request(
        f"response_format type must be text, json_object or json_schema, got {value.type!r}",
        param="response_format",
    )


def _from_structured_outputs(value: StructuredOutputsField) -> StructuredOutput:
    param = "structured_outputs"
    _check_backend(value.backend, param)
    spec = _constraint_of(value, param)
    if value.disable_any_whitespace is None:
        return spec
    if spec.kind not in ("json", "json_object"):
        raise bad_request(
            f"{param}.disable_any_whitespace applies to json and json_object only", param
        )
    return msgspec.structs.replace(spec, disable_any_whitespace=value.disable_any_whitespace)


def _constraint_of(value: StructuredOutputsField, param: str) -> StructuredOutput:
    given = [
        name
        for name in ("json", "regex", "choice", "grammar", "json_object")
        if getattr(value, name) not in (None, False)
    ]
    if len(given) != 1:
        raise bad_request(
            f"{param} takes exactly one of json, regex, choice, grammar, json_object; "
            f"got {', '.join(given) or 'none'}",
            param=param,
        )
    if value.json is not None:
        return StructuredOutput(json=check_json_schema(value.json, param))
    if value.regex is not None:
        return _regex(value.regex, param)
    if value.choice is not None:
        return _choice(value.choice, param)
    if value.grammar is not None:
        return _grammar(value.grammar, param)
    return StructuredOutput(json_object=True)


def _check_backend(backend: str | None, param: str) -> None:
    if backend is not None and backend not in BACKENDS:
        raise bad_request(
            f"{param}: backend {backend!r} is not available; pdserve runs xgrammar", param
        )


def with_whitespace_policy(
    spec: StructuredOutput | None, disable_any_whitespace: bool, request: Any = None
) -> StructuredOutput | None:
    """A JSON constraint under the server's whitespace policy, unless the request's
    `structured_outputs.disable_any_whitespace` set its own."""
    if spec is None or spec.kind not in ("json", "json_object"):
        return spec
    own = getattr(request, "structured_outputs", None)
    if own is not None and own.disable_any_whitespace is not None:
        return spec
    return msgspec.structs.replace(spec, disable_any_whitespace=disable_any_whitespace)


def check_structured_outputs_config(text: str) -> StructuredOutputsConfig:
    """The flag's JSON, checked; a ValueError names what is wrong in one line."""
    try:
        config = msgspec.json.decode(text, type=StructuredOutputsConfig)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a JSON object of backend, disable_any_whitespace: {exc}") from None
    if config.backend not in BACKENDS:
        raise ValueError(f"backend {config.backend!r} is not available; pdserve runs xgrammar")
    return config


def structured_output_of(request: Any) -> StructuredOutput | None:
    """The constraint a request asks for, or None; two ways of asking at once is a 400."""
    found: list[tuple[str, StructuredOutput]] = []
    if request.response_format is not None:
        spec = _from_response_format(request.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(request.structured_outputs)))
    _check_backend(request.guided_decoding_backend, "guided_decoding_backend")
    if request.guided_json is not None:
        schema = check_json_schema(request.guided_json, "guided_json")
        found.append(("guided_json", StructuredOutput(json=schema)))
    if request.guided_regex is not None:
        found.append(("guided_regex", _regex(request.guided_regex, "guided_regex")))
    if request.guided_choice is not None:
        found.append(("guided_choice", _choice(request.guided_choice, "guided_choice")))
    if request.guided_grammar is not None:
        found.append(("guided_grammar", _grammar(request.guided_grammar, "guided_grammar")))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one output constraint per request; got {names}", found[1][0])
    return found[0][1] if found else None
