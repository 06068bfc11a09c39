"""Instance kinds by role name, imported only when one is started.

The prefill and decode kinds live in their own rooms (`prefill/`, `decode/`); each is an
`InstanceRuntime` subclass registered here under its role.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.instance.loop import InstanceRuntime

INSTANCE_KINDS = {
    "colocated": "pdserve.instance.colocated:ColocatedRuntime",
    "prefill": "pdserve.prefill.instance:PrefillRuntime",
    "decode": "pdserve.decode.instance:DecodeRuntime",
}


class UnknownInstanceKind(ValueError):
    """A role with no runtime (or one not built yet); the message is one line."""


def kind_available(role: str) -> bool:
    """Whether the role's module exists, without importing it (nor torch)."""
    target = INSTANCE_KINDS.get(role)
    if target is None:
        return False
    try:
        return importlib.util.find_spec(target.partition(":")[0]) is not None
    except ModuleNotFoundError:
        return False


def runtime_class(role: str) -> type[InstanceRuntime]:
    target = INSTANCE_KINDS.get(role)
    if target is None:
        raise UnknownInstanceKind(
            f"unknown instance role {role!r}; known: {', '.join(INSTANCE_KINDS)}"
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise UnknownInstanceKind(
                f"the {role} instance kind is not available yet ({module_name} is missing)"
            ) from None
        raise
    return getattr(module, class_name)
