"""pdserve: disaggregated prefill/decode LLM serving.

    from pdserve import LLM, SamplingParams

The rooms (`pdserve.engine`, `pdserve.scheduler`, ...) live in folders at the
repository's top level; an installed wheel maps them under `pdserve/`. In a bare
checkout (no install, e.g. the GPU check on a machine without network) this package
finds them beside itself. The public names load on first use, so importing a torch-free
room (`pdserve.scheduler`, `pdserve.gateway`) never loads torch. `cli.py` is the one
command-line entry point (`pdserve serve|bench|plan|eval`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "scheduler").is_dir():
    __path__.append(str(_CHECKOUT))  # noqa: F821

_PUBLIC = {
    "LLM": "pdserve.engine.llm",
    "CompletionOutput": "pdserve.engine.llm",
    "RequestOutput": "pdserve.engine.llm",
    "SamplingParams": "pdserve.common.sampling_params",
}

if TYPE_CHECKING:
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
