"""A JSON file a user pointed pdserve at (a checkpoint's config, a tokenizer's), read with
an error that says where it is wrong, on one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_file(path: Path, error: type[Exception]) -> Any:
    """The parsed file, or `error` naming the path and the line and column of a syntax
    error or why the file cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise error(f"{path}: malformed JSON at {where}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise error(f"{path}: cannot read: {reason}") from None
