"""`pdserve serve --tokenizer FOLDER --chat-template FILE|TEMPLATE`, as in vLLM: the
gateway renders prompts with that tokenizer and template; a bad value is one line."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from pdserve.engine.embedded import embedded_model_path
from pdserve.gateway.app import create_app
from pdserve.gateway.gateway import Gateway, GatewayConfig
from pdserve.text.tokenizer import TokenizerError, read_chat_template

TEMPLATE = "[chat]{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE == read_chat_template(TEMPLATE)
    with pytest.raises(TokenizerError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_the_gateway_renders_with_the_given_tokenizer_and_template(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_path() / name, tokenizer / name)
    config = GatewayConfig(
        str(tmp_path / "weights-only"), ["m"], tokenizer_path=str(tokenizer), chat_template=TEMPLATE
    )
    gateway = Gateway(config)
    try:
        body = {"messages": MESSAGES, "return_token_strs": False}
        tokens = TestClient(create_app(gateway)).post("/tokenize", json=body).json()["tokens"]
        assert gateway.tokenizer.decode(tokens) == "[chat]<user>Hi"
    finally:
        asyncio.run(gateway.close())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chat-template", "/no/such/template.jinja"], "--chat-template: chat template"),
        (["--tokenizer", "/no/such/tokenizer"], "--tokenizer /no/such/tokenizer: no such"),
    ],
)
def test_bad_tokenizer_flags_are_one_line(flags: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--mode", "colocated", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
