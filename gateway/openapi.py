"""GET /openapi.json: the API described from the request types themselves, limits included.

The bodies' schemas come from the msgspec Structs the handlers decode (`schemas.py`), so
the description cannot drift from what is accepted; the limits that `limits.py`,
`sampling.py` and `prompts.py` enforce are written into them (maxItems, maxLength,
minimum, maximum), so a client generator or a fuzzer sees the same bounds the server
checks. Every error is described by one OpenAI-style error body.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import msgspec

from pdserve.common.sampling_params import MAX_LOGIT_BIAS_VALUE, MAX_LOGPROBS
from pdserve.gateway import limits
from pdserve.gateway.prompts import MAX_PROMPTS
from pdserve.gateway.responses_request import ResponsesRequest
from pdserve.gateway.sampling import MAX_N
from pdserve.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pdserve.gateway.structured import MAX_SCHEMA_CHARS

REF = "#/components/schemas/{name}"
BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
# field → JSON-schema keywords added to its (non-null) schema
SHARED_LIMITS: dict[str, dict[str, Any]] = {
    "model": {"maxLength": limits.MAX_MODEL_NAME_CHARS},
    "n": {"minimum": 1, "maximum": MAX_N},
    "stop": {"maxItems": limits.MAX_STOP_STRINGS, "maxLength": limits.MAX_STOP_STRING_CHARS},
    "stop_token_ids": {"maxItems": limits.MAX_STOP_TOKEN_IDS},
    "cache_salt": {"maxLength": limits.MAX_CACHE_SALT_CHARS},
    "logit_bias": {
        "maxProperties": limits.MAX_LOGIT_BIAS,
        "additionalProperties": {
            "type": "number",
            "minimum": -MAX_LOGIT_BIAS_VALUE,
            "maximum": MAX_LOGIT_BIAS_VALUE,
        },
    },
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "user": {"maxLength": limits.MAX_USER_CHARS},
    "metadata": {"maxProperties": limits.MAX_METADATA},
    "top_k": {"minimum": -1, "maximum": limits.MAX_TOP_K},
    "seed": {"minimum": -(1 << 63), "maximum": (1 << 63) - 1},
    "temperature": {"minimum": 0, "maximum": 100},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "min_tokens": {"minimum": 0},
    "max_tokens": {"minimum": 1},
    "guided_regex": {"maxLength": limits.MAX_CONSTRAINT_CHARS},
    "guided_grammar": {"maxLength": limits.MAX_CONSTRAINT_CHARS},
    "guided_choice": {"maxItems": limits.MAX_CHOICES, "minItems": 1},
    "guided_json": {"maxLength": MAX_SCHEMA_CHARS},
}
OWN_LIMITS: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionRequest": {
        "prompt": {"maxItems": MAX_PROMPTS},
        "best_of": {"minimum": 1, "maximum": MAX_N},
        "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
        "max_tokens": {"minimum": 0},  # 0: with echo, the prompt alone
    },
    "ChatCompletionRequest": {
        "messages": {"maxItems": limits.MAX_MESSAGES, "minItems": 1},
        "chat_template_kwargs": {"maxProperties": limits.MAX_CHAT_TEMPLATE_KWARGS},
        "tools": {"maxItems": limits.MAX_TOOLS},
        "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
        "max_completion_tokens": {"minimum": 1},
    },
    "ResponsesRequest": {
        "input": {"maxItems": limits.MAX_MESSAGES, "minItems": 1},
        "tools": {"maxItems": limits.MAX_TOOLS},
        "max_output_tokens": {"minimum": 1},
    },
    "DetokenizeRequest": {"tokens": {"maxItems": limits.MAX_DETOKENIZE_TOKENS}},
}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def openapi_document(title: str = "pdserve", version: str | None = None) -> dict[str, Any]:
    if version is None:
        try:
            version = importlib.metadata.version("pdserve")
        except importlib.metadata.PackageNotFoundError:  # a bare checkout
            version = "unreleased"
    (_, components) = msgspec.json.schema_components(list(BODIES.values()), ref_template=REF)
    for name, schema in components.items():
        if name in {t.__name__ for t in BODIES.values()}:
            _add_limits(schema, {**SHARED_LIMITS, **OWN_LIMITS.get(name, {})})
    components["Error"] = ERROR
    paths: dict[str, Any] = {
        path: {"post": _operation(body.__name__)} for path, body in BODIES.items()
    }
    paths["/v1/models"] = {"get": _operation(None)}
    paths["/health"] = {"get": {"security": [], **_operation(None)}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def _operation(body: str | None) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(name="Error")}}}}
    operation: dict[str, Any] = {
        "responses": {
            "200": {"description": "OK"},
            "4XX": {"description": "the request was refused", **error},
            "503": {"description": "no instance can serve it now", **error},
        }
    }
    if body is not None:
        schema = {"$ref": REF.format(name=body)}
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    return operation


def _add_limits(schema: dict[str, Any], table: dict[str, dict[str, Any]]) -> None:
    properties = schema.get("properties", {})
    for field, keywords in table.items():
        if field in properties:
            properties[field] = _constrain(properties[field], keywords)


def _constrain(schema: dict[str, Any], keywords: dict[str, Any]) -> dict[str, Any]:
    """The keywords go on each alternative they apply to (numbers, strings, arrays,
    objects), and on the items of a string array for string ones."""
    alternatives = schema.get("anyOf")
    if alternatives is not None:
        return {**schema, "anyOf": [_constrain(a, keywords) for a in alternatives]}
    kind = schema.get("type")
    applies = {
        "integer": ("minimum", "maximum", "exclusiveMinimum"),
        "number": ("minimum", "maximum", "exclusiveMinimum"),
        "string": ("maxLength",),
        "array": ("maxItems", "minItems"),
        "object": ("maxProperties",),
    }.get(str(kind), ())
    out = {**schema, **{k: v for k, v in keywords.items() if k in applies}}
    items = schema.get("items")
    string_items = isinstance(items, dict) and items.get("type") == "string"
    if kind == "array" and isinstance(items, dict) and string_items and "maxLength" in keywords:
        out["items"] = {**items, "maxLength": keywords["maxLength"]}
    return out
