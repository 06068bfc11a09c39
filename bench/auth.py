"""The API key of the server under test, as vLLM's benchmark takes it: `OPENAI_API_KEY`."""

from __future__ import annotations

import os


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """`Authorization: Bearer` with `api_key`, else `OPENAI_API_KEY`; {} when neither."""
    key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}
