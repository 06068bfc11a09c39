"""The JSON grammar the rank compiles: numbers end within what their type can hold, the
schema's own bounds win, and whitespace between tokens is free unless turned off."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from pdserve.engine.json_grammar import MAX_WHITESPACE_RUN, bound_ranges, json_schema_grammar

COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo([]))  # strings only: no vocabulary needed


def accepts(schema: dict, text: str, any_whitespace: bool = True) -> bool:
    """Whether `text` is a whole value of the schema's grammar."""
    grammar = json_schema_grammar(json.dumps(schema), any_whitespace)
    matcher = xgr.GrammarMatcher(COMPILER.compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


NUMBER = {"type": "number"}
INTEGER = {"type": "integer"}


@pytest.mark.parametrize(
    "text", ["0", "-0.5", "123.45", "1e308", "-2.5E-12", "1.2345678901234567",
             "12345678901234567", "0.12345678901234567", "9.999e+999"],
)  # fmt: skip
def test_a_number_takes_every_spelling_of_17_significant_digits(text: str) -> None:
    assert accepts(NUMBER, text)


@pytest.mark.parametrize(
    "text", ["123456789012345678", "1.23456789012345678", "123.000000000000001",
             "0.123456789012345678", "1e1000", "01"],
)  # fmt: skip
def test_a_number_never_runs_past_17_significant_digits_or_a_3_digit_exponent(text: str) -> None:
    assert not accepts(NUMBER, text)


def test_an_integer_holds_19_digits_and_a_sign() -> None:
    assert accepts(INTEGER, "9223372036854775807")
    assert accepts(INTEGER, "-9223372036854775808")
    assert accepts(INTEGER, "9999999999999999999")
    assert not accepts(INTEGER, "10000000000000000000")
    assert not accepts(INTEGER, "1.5")


def test_numbers_inside_any_json_value_are_bounded_too() -> None:
    schema = {"type": "object"}  # json_object mode
    assert accepts(schema, '{"a": [1.5, -2, {"b": 1e10}]}')
    assert not accepts(schema, '{"a": 1' + "0" * 25 + "}")


def test_a_range_open_on_one_side_is_closed_at_the_types_reach() -> None:
    low = {"type": "integer", "minimum": 0}
    assert accepts(low, "9223372036854775807")
    assert not accepts(low, "9223372036854775808") and not accepts(low, "-1")
    high = {"type": "integer", "exclusiveMaximum": 10}
    assert accepts(high, "-9223372036854775808") and not accepts(high, "10")
    positive = {"type": ["number", "null"], "minimum": 0.5}
    assert accepts(positive, "12345.25") and accepts(positive, "null")
    assert not accepts(positive, "1" + "0" * 18)


def test_the_schemas_own_bounds_win() -> None:
    narrow = {"type": "integer", "minimum": 0, "maximum": 10}
    assert accepts(narrow, "10") and not accepts(narrow, "11")
    wide = {"type": "number", "minimum": 0, "maximum": 1e25}
    assert bound_ranges(wide) == wide
    beyond = {"type": "number", "minimum": 1e20}  # past the added side: left as it is
    assert bound_ranges(beyond) == beyond
    nested = {"type": "array", "items": {"type": "integer", "maximum": 5}}
    assert bound_ranges(nested)["items"]["minimum"] == -(1 << 63)
    data = {"const": {"type": "integer", "minimum": 0}, "enum": [{"type": "number", "maximum": 1}]}
    assert bound_ranges(data) == data  # values, not schemas: never rewritten
    deep = {"$defs": {"n": {"type": "integer", "minimum": 1}}, "anyOf": [{"$ref": "#/$defs/n"}]}
    assert bound_ranges(deep)["$defs"]["n"]["maximum"] == (1 << 63) - 1


def test_whitespace_between_tokens_is_free_unless_turned_off() -> None:
    schema = {"type": "object", "properties": {"a": INTEGER}, "required": ["a"]}
    loose = '{\n  "a" :\n\n 1 }'
    assert accepts(schema, loose)
    assert not accepts(schema, loose, any_whitespace=False)
    assert accepts(schema, '{"a": 1}', any_whitespace=False)


def test_a_run_of_whitespace_between_tokens_is_bounded() -> None:
    """A greedy model that keeps picking newlines must come to the next token."""
    schema = {"type": "object", "properties": {"a": INTEGER}, "required": ["a"]}
    nested = {"type": "object", "properties": {"b": schema}, "required": ["b"]}
    assert accepts(schema, '{"a": 1' + "\n" * MAX_WHITESPACE_RUN + "}")
    assert not accepts(schema, '{"a": 1' + "\n" * (MAX_WHITESPACE_RUN + 1) + "}")
    pretty = json.dumps({"b": {"a": 1}}, indent=2)
    assert accepts(nested, pretty) and accepts(nested, pretty.replace("  ", " " * 7))
