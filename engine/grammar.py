"""Structured output on a rank: grammars compiled off the step loop, token masks at sampling.

A request's `StructuredOutput` is compiled (xgrammar) on a background thread when the
driver asks (`prepare`, through the executor), long before the request's first step; the
driver keeps the request out of its scheduler until then. Compiled grammars are kept in a
bounded cache keyed by the constraint, so a repeated schema compiles once. Each running
request gets a matcher; it is rebuilt from the request's output tokens whenever the rank
sees the request anew (after the P→D handoff, the decode instance replays the prefill
instance's first token), so the mask follows the request wherever it runs.

xgrammar (and the transformers tokenizer it reads the vocabulary from) is imported on the
compile thread the first time a request asks for structured output.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any

import torch

from pdserve.common.structured_output import StructuredOutput
from pdserve.engine.json_grammar import json_schema_grammar

MAX_CACHED_GRAMMARS = 128
CACHE_LIMIT_BYTES = 64 << 20  # xgrammar's own cache of compiled token masks


class GrammarError(ValueError):
    """A constraint that cannot be compiled for this model's vocabulary."""


class GrammarBook:
    def __init__(
        self,
        tokenizer_folder: str,
        vocab_size: int,
        stop_token_ids: list[int],
        compile_timeout_s: float = 30.0,
    ) -> None:
        """`compile_timeout_s`: the longest a step waits for a grammar it needs (the
        driver's `grammar_compile_timeout_s`; a rank's copy can lag the driver's)."""
        self.compile_timeout_s = compile_timeout_s
        self.tokenizer_folder = tokenizer_folder
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[str, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()  # `prepare` runs on the driver, compiles on the pool
        self._compiler: Any = None
        self.matchers: dict[str, Any] = {}  # request id → its xgrammar GrammarMatcher

    def prepare(self, spec: StructuredOutput) -> Future[Any]:
        """The compiled grammar of `spec`, as a future (done at once when cached)."""
        with self._lock:
            future = self._compiled.get(spec.key)
            if future is not None:
                self._compiled.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._compiled[spec.key] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- matchers ---------------------------------------------------------------------------

    def start(self, request_id: str, spec: StructuredOutput, output_token_ids: list[int]) -> None:
        """A matcher for a request the rank has just received, advanced past the output
        tokens it already has (sampled elsewhere, or before a preemption)."""
        import xgrammar as xgr

        # The driver admitted it, so it compiled there; this rank's copy may still be
        # compiling (or stuck): the step waits a bounded time, then fails as any step.
        try:
            compiled = self.prepare(spec).result(timeout=self.compile_timeout_s)
        except FuturesTimeout:
            raise GrammarError(
                f"request {request_id}: its {spec.kind} grammar did not compile on this rank "
                f"within {self.compile_timeout_s:g} s"
            ) from None
        matcher = xgr.GrammarMatcher(compiled)
        for token in output_token_ids:
            if not matcher.accept_token(token):
                raise GrammarError(f"request {request_id}: token {token} breaks its grammar")
        self.matchers[request_id] = matcher

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Sets the logits of every token its grammar forbids to -inf, row by row (in place)."""
        rows = [(i, self.matchers[r]) for i, r in enumerate(request_ids) if r in self.matchers]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        done = []  # complete, and kept going (min_tokens): only the end may follow
        for i, matcher in rows:
            if matcher.is_terminated():
                done.append(i)
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        indices = [i for i, _ in rows if i not in done]
        if indices:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=indices
            )
        with torch.inference_mode():  # the logits were made under it
            for i in done:
                stops = logits[i, self.stop_token_ids].clone()
                logits[i] = float("-inf")
                logits[i, self.stop_token_ids] = stops

    def advance(self, request_id: str, token: int) -> None:
        matcher = self.matchers.get(request_id)
        if matcher is not None and not matcher.is_terminated():
            matcher.accept_token(token)

    # ---- compiling (on the pool's thread) ------------------------------------------------

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._compiler or self._make_compiler()
        try:
            if spec.json is not None or spec.json_object:
                # json_object: an object, as OpenAI's json_object mode promises
                schema = spec.json if spec.json is not None else '{"type": "object"}'
                any_whitespace = not spec.disable_any_whitespace
                return compiler.compile_grammar(json_schema_grammar(schema, any_whitespace))
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar or "")
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses
            message = _one_line(exc)
            raise GrammarError(f"the {spec.kind} constraint does not compile: {message}") from None

    def _make_compiler(self) -> Any:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        path = Path(self.tokenizer_folder) / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(f"structured output needs the model's tokenizer: {path} is missing")
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=2, cache_limit_bytes=CACHE_LIMIT_BYTES
        )
        return self._compiler


def _one_line(exc: BaseException) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", line)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
