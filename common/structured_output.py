"""What a request's output must match, as vLLM's `StructuredOutputsParams` says it.

Exactly one constraint per request: a JSON schema (`json`, serialized), any JSON object
(`json_object`), a regular expression, one of a list of strings (`choice`), or an EBNF
grammar (`grammar`); a JSON constraint also says whether whitespace between its tokens
is free (`docs/structured-output.md`). Torch-free and plain data: it travels inside
`SamplingParams` from the gateway to the prefill instance and on, with the handoff, to
the decode instance, where each compiles it (xgrammar) and masks the tokens it samples.
"""

from __future__ import annotations

import msgspec

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    json: str | None = None  # a JSON schema, serialized as JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF, in xgrammar's (GBNF-like) dialect
    # JSON only: compact separators instead of any whitespace between tokens (vLLM's
    # name; its default, off, lets the model write `{\n  "a": 1}` as it likes).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured output takes exactly one of {', '.join(KINDS)}; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if self.disable_any_whitespace and given[0] not in ("json", "json_object"):
            raise ValueError("disable_any_whitespace applies to json and json_object only")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> str:
        """One string per distinct constraint: the compiled-grammar cache's key."""
        return msgspec.json.encode(self).decode()
