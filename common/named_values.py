"""Keyword arguments read by name off parsed flags or a config object."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def named_values(source: object, names: Iterable[str]) -> dict[str, Any]:
    """Each of `names` with its value on `source`: for building a config whose fields
    carry the same names as the flags (or the other config) it is made from. A name
    `source` lacks is an AttributeError, never a silent default."""
    return {name: getattr(source, name) for name in names}
