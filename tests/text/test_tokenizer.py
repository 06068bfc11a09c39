"""The tokenizer wrapper: encode/decode, special ids, and chat templates rendered exactly as
transformers renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from pdserve.text.tokenizer import Tokenizer, TokenizerError
from tests.chat_messages import assistant_tool_call
from tests.repo_python import run_python

# A Qwen2.5-style template: system default, tools as JSON, tool calls and tool responses.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions.\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- set plain = (message.role == "user") or (message.role == "system" and not loop.first) %}
    {%- if plain or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# No whitespace-control dashes: output depends on trim_blocks/lstrip_blocks. Also uses
# namespace, loop controls, the bos/eos variables, the generation block and strftime_now.
FEATURE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message.role == 'system' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    [{{ ns.turns }}] {{ message.role | upper }}: {{ message.content | trim }}
    {% if message.role == 'assistant' %}
    {% generation %}{{ eos_token }}{% endgeneration %}
    {% endif %}
    {% if ns.turns >= 4 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[{{ ns.turns + 1 }}] ASSISTANT ({{ strftime_now('%Y') }}):{% endif %}
{{ extra_note | default('no note') }} {{ {'k': 'é<b>', 'n': [1, 2]} | tojson }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "  Another one, with unicode: café 日本 😀  "},
        {"role": "assistant", "content": "Red.\n\nAnything else?"},
        {"role": "user", "content": "No."},
    ],
    [
        {"role": "system", "content": "Rules:\n1. be kind\n2. be brief"},
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    assistant_tool_call("get_weather", {"city": "Paris"}),
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"sky": "clear"}'},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_folder: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(embedded_folder))


def test_embedded_tokenizer_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.pad_token_id == 2
    assert tokenizer.vocab_size == 49152
    assert tokenizer.special_tokens["bos_token"] == "<|im_start|>"
    assert tokenizer.special_tokens["eos_token"] == "<|im_end|>"
    assert set(range(17)) == tokenizer.all_special_ids
    assert tokenizer.convert_ids_to_tokens([1, 2, 0]) == [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
    ]


def test_encode_decode_round_trip(tokenizer: Tokenizer) -> None:
    for text in ["Hello, world!", "naïve café — 日本語 😀🎉", "  x = [1, 22, 333]\n\tend  "]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    # Digits are split one by one, as SmolLM2 was trained.
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2024")) == ["2", "0", "2", "4"]


@pytest.mark.slow
def test_encode_matches_transformers_on_our_folder(tokenizer: Tokenizer, hf_tokenizer) -> None:
    for text in ["Hello  world", "x\n\n12. item", "<|im_start|>a<|im_end|>", "ümlaut 😀"]:
        for special in (True, False):
            assert tokenizer.encode(text, special) == hf_tokenizer.encode(
                text, add_special_tokens=special
            )


@pytest.mark.slow
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_embedded_template_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer, generation_prompt: bool
) -> None:
    for conversation in CONVERSATIONS:
        ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
        theirs = hf_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=generation_prompt, tokenize=False
        )
        assert ours == theirs
    assert ours.startswith("<|im_start|>system\n")
    assert ours.endswith("<|im_start|>assistant\n") == generation_prompt


@pytest.mark.slow
@pytest.mark.parametrize("template", [QWEN_TEMPLATE, FEATURE_TEMPLATE], ids=["qwen", "features"])
def test_other_templates_match_transformers(tokenizer: Tokenizer, hf_tokenizer, template) -> None:
    cases = [(c, None) for c in CONVERSATIONS] + [
        (TOOL_CONVERSATION, TOOLS),
        (CONVERSATIONS[1], TOOLS),
    ]
    for conversation, tools in cases:
        for generation_prompt in (True, False):
            kwargs = {"add_generation_prompt": generation_prompt, "tools": tools}
            ours = tokenizer.apply_chat_template(conversation, chat_template=template, **kwargs)
            theirs = hf_tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False, **kwargs
            )
            assert ours == theirs
    with_note = tokenizer.apply_chat_template(
        CONVERSATIONS[0], chat_template=FEATURE_TEMPLATE, extra_note="NOTE"
    )
    assert "NOTE" in with_note
    assert with_note == hf_tokenizer.apply_chat_template(
        CONVERSATIONS[0], chat_template=FEATURE_TEMPLATE, tokenize=False,
        add_generation_prompt=True, extra_note="NOTE",
    )  # fmt: skip


def test_template_errors_are_one_line(tokenizer: Tokenizer) -> None:
    cases = [
        ("{% if %}", "chat template error"),
        ("{{ raise_exception('Only user and assistant roles\nare supported') }}", "roles"),
        ("{% for m in messages %}{{ m.nope.deeper }}{% endfor %}", "chat template"),
        ("{{ messages[5].content }}", "no element 5"),
        ("{{ messages.pop() }}", "chat template"),  # the sandbox refuses to mutate input
    ]
    for template, fragment in cases:
        with pytest.raises(TokenizerError) as error:
            tokenizer.apply_chat_template(CONVERSATIONS[0], chat_template=template)
        assert "\n" not in str(error.value) and fragment in str(error.value)
    for bad in ([], "hello", [["role", "user"]]):
        with pytest.raises(TokenizerError):
            tokenizer.apply_chat_template(bad)


# ---- folders with other layouts -----------------------------------------------------------------


def write_tiny_tokenizer(folder: Path, tokenizer_config: dict, generation: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<|eot|>": 3, "hello": 4, "world": 5}
    backend = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<|eot|>")])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_special_ids_from_both_configs(tmp_path: Path) -> None:
    folder = write_tiny_tokenizer(
        tmp_path,
        {
            "bos_token": {"content": "<s>", "special": True},
            "eos_token": "</s>",
            "add_bos_token": True,
        },
        {"eos_token_id": [3, 2]},
    )
    tok = Tokenizer.from_folder(folder)
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.eos_token_ids == [3, 2]  # generation_config first, tokenizer's eos not repeated
    assert tok.encode("hello world") == [1, 4, 5]  # add_bos_token honoured
    assert tok.encode("hello world", add_special_tokens=False) == [4, 5]
    assert tok.decode([1, 4, 5, 3]) == "hello world"
    only_tokenizer = write_tiny_tokenizer(tmp_path / "b", {"eos_token": "<|eot|>"})
    assert Tokenizer.from_folder(only_tokenizer).eos_token_ids == [3]


def test_named_templates_and_template_files(tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    tok = Tokenizer.from_folder(write_tiny_tokenizer(tmp_path / "a", {"chat_template": named}))
    assert tok.apply_chat_template(CONVERSATIONS[1]) == "D2"
    assert tok.apply_chat_template(CONVERSATIONS[1], tools=TOOLS) == "T1"
    folder = write_tiny_tokenizer(tmp_path / "b", {"chat_template": "from config"})
    assert Tokenizer.from_folder(folder).apply_chat_template(CONVERSATIONS[0]) == "from config"
    (folder / "chat_template.jinja").write_text("from file {{ messages[0].content }}")
    assert Tokenizer.from_folder(folder).apply_chat_template(CONVERSATIONS[0]) == "from file Hello!"
    no_template = Tokenizer.from_folder(write_tiny_tokenizer(tmp_path / "c", {}))
    with pytest.raises(TokenizerError, match="no chat template"):
        no_template.apply_chat_template(CONVERSATIONS[0])


def test_broken_tokenizer_folders(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="missing tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    folder = write_tiny_tokenizer(tmp_path / "a", {})
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: malformed JSON"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot load") as error:
        Tokenizer.from_folder(folder)
    assert "\n" not in str(error.value)


def test_modules_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pdserve.text.tokenizer, pdserve.text.detokenizer\n"
        "print('ok')"
    )
    result = run_python("-c", code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
