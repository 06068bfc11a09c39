"""The tokenizer of a checkpoint folder, with chat templates rendered as transformers renders them.

No torch here: the gateway imports this module to tokenize and to apply chat templates.

    tok = Tokenizer.from_folder(path)
    prompt = tok.apply_chat_template(messages)              # add_generation_prompt=True
    ids = tok.encode(prompt, add_special_tokens=False)      # the template wrote its own specials
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from pdserve.common.json_file import read_json_file

# The named special tokens a chat template sees as variables (transformers' list).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer folder or chat template that cannot be used; the message is one line."""


class Tokenizer:
    """A `tokenizers` tokenizer plus what tokenizer_config.json and generation_config.json add."""

    def __init__(
        self,
        backend: RustTokenizer,
        config: Mapping[str, Any] | None = None,
        generation_eos_ids: Sequence[int] = (),
        chat_templates: Mapping[str, str] | None = None,
        name: str = "tokenizer",
    ):
        self.backend = backend
        self.config = dict(config or {})
        self.name = name
        self.chat_templates = dict(chat_templates or {})
        self.special_tokens = {
            key: token
            for key in SPECIAL_TOKEN_NAMES
            if (token := _token_content(self.config.get(key))) is not None
        }
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.pad_token_id = self.token_to_id(self.special_tokens.get("pad_token"))
        eos_ids = list(generation_eos_ids)
        config_eos = self.token_to_id(self.special_tokens.get("eos_token"))
        if config_eos is not None and config_eos not in eos_ids:
            eos_ids.append(config_eos)
        self.eos_token_ids = eos_ids
        self.eos_token_id = config_eos if config_eos is not None else next(iter(eos_ids), None)
        self.add_bos_token = bool(self.config.get("add_bos_token", False))

    # ---- loading ---------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise TokenizerError(f"{root}: no such tokenizer folder")
        path = root / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: missing tokenizer.json")
        try:
            backend = RustTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises bare Exceptions for bad files
            raise TokenizerError(f"{path}: cannot load: {_one_line(exc)}") from None
        config = _read_json_object(root / "tokenizer_config.json")
        generation = _read_json_object(root / "generation_config.json")
        eos = generation.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
        templates = _load_chat_templates(root, config)
        return cls(backend, config, eos_ids, templates, name=str(root))

    # ---- vocabulary ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model's may be padded larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        decoder = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in decoder.items() if token.special)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    # ---- text ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a string, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer_config's add_bos_token asks for a BOS that some tokenizer.json files omit.
        bos = self.bos_token_id
        wants_bos = add_special_tokens and self.add_bos_token
        if wants_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ------------------------------------------------------------------------------

    def chat_template(self, tools: Sequence[Any] | None = None, name: str | None = None) -> str:
        """The template to render: `name` if given, else tool_use (with tools) or default."""
        if not self.chat_templates:
            raise TokenizerError(f"{self.name}: the tokenizer has no chat template")
        if name is not None:
            if name not in self.chat_templates:
                known = ", ".join(sorted(self.chat_templates))
                raise TokenizerError(f"{self.name}: no chat template named {name!r} ({known})")
            return self.chat_templates[name]
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        known = ", ".join(sorted(self.chat_templates))
        raise TokenizerError(f"{self.name}: several chat templates ({known}) and none is default")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """The conversation as prompt text; encode it with add_special_tokens=False."""
        template = self.chat_template(tools) if chat_template is None else chat_template
        variables = {**self.special_tokens, **extra}
        return render_chat_template(
            template, messages, add_generation_prompt, tools, documents, **variables
        )


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Render like transformers' apply_chat_template(tokenize=False): same environment, same
    message clean-up (None-valued keys dropped, reasoning fields aliased)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise TokenizerError("chat messages must be a non-empty list of objects")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TokenizerError(f"chat message must be an object, got {type(message).__name__}")
        chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise TokenizerError("tools must be a list of JSON schema objects")
    try:
        compiled = compile_chat_template(template)
        return compiled.render(
            messages=chat,
            tools=list(tools) if tools is not None else None,
            documents=list(documents) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except TokenizerError:
        raise
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template error: {_one_line(exc)}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
        raise TokenizerError(
            f"chat template failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None


_COMPILED: dict[str, jinja2.Template] = {}


def compile_chat_template(template: str) -> jinja2.Template:
    if not isinstance(template, str):
        raise TokenizerError(f"chat template must be a string, got {type(template).__name__}")
    compiled = _COMPILED.get(template)
    if compiled is None:
        compiled = _chat_environment().from_string(template)
        if len(_COMPILED) < 64:  # a handful of models per process; never grow without bound
            _COMPILED[template] = compiled
    return compiled


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
    serving it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names so a template cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own tojson, no HTML escaping: prompts are not HTML.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    # transformers reads a message's reasoning under any of three names and offers it to the
    # template as `reasoning_content` and as `thinking`.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def read_chat_template(value: str) -> str:
    """`--chat-template`, as vLLM takes it: a template file, or the template itself."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"chat template {path}: cannot read: {_one_line(exc)}") from None
    if "{{" in value or "{%" in value:
        return value
    raise TokenizerError(f"chat template {value}: no such file (nor a template: no {{{{ or {{%)")


def _load_chat_templates(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Templates by name from tokenizer_config.json, chat_template.json, chat_template.jinja and
    additional_chat_templates/*.jinja (later sources win, as in transformers' saved layout)."""
    templates: dict[str, str] = {}
    _add_templates(templates, config.get("chat_template"), root / "tokenizer_config.json")
    json_path = root / "chat_template.json"
    if json_path.is_file():
        payload = _read_json_object(json_path).get("chat_template")
        _add_templates(templates, payload, json_path)
    jinja_path = root / "chat_template.jinja"
    if jinja_path.is_file():
        templates["default"] = jinja_path.read_text(encoding="utf-8")
    extra = root / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


def _add_templates(templates: dict[str, str], value: Any, path: Path) -> None:
    if value is None:
        return
    if isinstance(value, str):
        templates["default"] = value
        return
    entries: Iterable[tuple[Any, Any]] | None = (
        value.items() if isinstance(value, Mapping) else None
    )
    if isinstance(value, list):
        pairs = [(e.get("name"), e.get("template")) for e in value if isinstance(e, Mapping)]
        entries = pairs if len(pairs) == len(value) else None
    if entries is None:
        raise TokenizerError(f"{path}: chat_template must be a string or a list of named templates")
    for name, template in entries:
        if not isinstance(name, str) or not isinstance(template, str):
            raise TokenizerError(f"{path}: a named chat template needs a string name and template")
        templates[name] = template


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = read_json_file(path, TokenizerError)
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
