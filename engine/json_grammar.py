"""A JSON schema as the EBNF grammar the rank compiles: xgrammar's conversion, with every
number bounded so that a value always ends.

xgrammar turns a schema into EBNF whose numbers may run on forever (`[1-9] [0-9]*`): a
model that keeps choosing digits writes them until `max_tokens`, and the client gets
unparsable JSON. Here a number's digits are bounded by what its type can hold, unless
the schema's own bounds say otherwise:

- an integer has at most 19 digits and a sign (a signed 64-bit integer's range, and a
  little more: `9999999999999999999`);
- a number (a float) has at most 17 significant digits (enough for any double) and an
  exponent of at most 3 digits;
- a number or integer bounded on one side only (`minimum: 0`) gets the other side too
  (±(2⁶³ − 1) for an integer, ±10¹⁷ for a number), since xgrammar writes a bounded range
  digit by digit: both sides given, it needs nothing more.

Unbounded types are rewritten in xgrammar's own `basic_integer` and `basic_number` rules
(what `{"type": "number"}` and any JSON value refer to); one-sided ranges in the schema
before conversion. Torch-free; xgrammar is imported by the caller's thread.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Whitespace between two JSON tokens, at most: a greedy model can otherwise pick
# whitespace after whitespace until max_tokens (a known loop of unbounded JSON grammars);
# 16 still holds a newline and the indent of pretty-printed JSON seven levels deep.
MAX_WHITESPACE_RUN = 16
INT_DIGITS = 19  # a signed 64-bit integer has up to 19 digits
FLOAT_DIGITS = 17  # significant digits that tell any two doubles apart
EXPONENT_DIGITS = 3  # a double's exponent is below 309
INT_MAX = (1 << 63) - 1
FLOAT_MAX = 10**17  # xgrammar's ranges have no exponent: up to 17 integer digits

_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")


def bounded_integer_rule() -> str:
    return f'basic_integer ::= "0" | "-"? [1-9] [0-9]{{0,{INT_DIGITS - 1}}}'


def bounded_number_rules() -> list[str]:
    """A sign, a mantissa of at most 17 significant digits, an optional exponent. After
    "0." every digit counts (a smaller value takes the exponent), so every length is
    finite and every double still has a spelling."""
    last = FLOAT_DIGITS - 1
    forms = [f'"0" ("." [0-9]{{1,{FLOAT_DIGITS}}})?']
    for k in range(last):  # k digits after the first, then up to (last - k) decimals
        more = f" [0-9]{{{k}}}" if k else ""
        forms.append(f'[1-9]{more} ("." [0-9]{{1,{last - k}}})?')
    forms.append(f"[1-9] [0-9]{{{last}}}")
    return [
        'basic_number ::= "-"? basic_number_mantissa basic_number_exponent?',
        "basic_number_mantissa ::= " + " | ".join(f"({form})" for form in forms),
        f"basic_number_exponent ::= [eE] [+\\-]? [0-9]{{1,{EXPONENT_DIGITS}}}",
    ]


# Where a schema holds subschemas (values such as `const`, `enum` or `default` are data,
# and are never rewritten).
_ONE = (
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bound_ranges(schema: Any) -> Any:
    """A copy of `schema` in which every integer or number bounded on one side only is
    bounded on both (the side added lies beyond the given one, so no value the schema
    allows within the type's reach is lost)."""
    if not isinstance(schema, dict):
        return schema
    bounded = dict(schema)
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            bounded[key] = bound_ranges(schema[key])
    for key in _LIST:
        if isinstance(schema.get(key), list):
            bounded[key] = [bound_ranges(item) for item in schema[key]]
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            bounded[key] = {name: bound_ranges(sub) for name, sub in schema[key].items()}
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if types & {"integer", "number"}:
        limit = INT_MAX if "number" not in types else FLOAT_MAX
        lower = _given(schema, _LOWER)
        upper = _given(schema, _UPPER)
        if lower is not None and upper is None and lower < limit:
            bounded["maximum"] = limit
        if upper is not None and lower is None and upper > -limit:
            bounded["minimum"] = -limit - (1 if limit == INT_MAX else 0)
    return bounded


def _given(schema: dict[str, Any], names: tuple[str, ...]) -> float | None:
    values = [schema[n] for n in names if isinstance(schema.get(n), int | float)]
    return values[0] if values and not isinstance(values[0], bool) else None


def json_schema_grammar(schema: str, any_whitespace: bool) -> str:
    """The EBNF for one JSON value that `schema` (JSON text) allows, numbers bounded;
    `any_whitespace`: whitespace between tokens (vLLM's default), at most
    MAX_WHITESPACE_RUN characters at a time, else compact separators (`", "` and
    `": "`)."""
    import xgrammar as xgr

    bounded = json.dumps(bound_ranges(json.loads(schema)))
    run = MAX_WHITESPACE_RUN if any_whitespace else None
    grammar = xgr.Grammar.from_json_schema(
        bounded, any_whitespace=any_whitespace, max_whitespace_cnt=run
    )
    return bound_numbers(str(grammar))


def bound_numbers(ebnf: str) -> str:
    """xgrammar's `basic_integer` and `basic_number` rules replaced by bounded ones."""
    ebnf = _replace_rule(ebnf, "basic_integer", [bounded_integer_rule()])
    return _replace_rule(ebnf, "basic_number", bounded_number_rules())


def _replace_rule(ebnf: str, name: str, rules: list[str]) -> str:
    pattern = re.compile(rf"^{name} ::= .*$", re.MULTILINE)
    if len(pattern.findall(ebnf)) != 1:  # a new xgrammar that names its rules otherwise
        raise ValueError(f"xgrammar's JSON grammar has no single {name} rule to bound")
    for rule in rules[1:]:
        helper = rule.split(" ::= ", 1)[0]
        if re.search(rf"^{helper} ::= ", ebnf, re.MULTILINE):
            raise ValueError(f"xgrammar's JSON grammar already has a rule {helper}")
    return pattern.sub(lambda _: "\n".join(rules), ebnf)
