"""The embedded model (SmolLM2) as module-scoped fixtures: its prepared folder and its
tokenizer. A folder's conftest imports those its tests use."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.embedded import embedded_model_path
from pdserve.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def embedded_folder() -> Path:
    return embedded_model_path()


@pytest.fixture(scope="module")
def tokenizer(embedded_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(embedded_folder)
