"""A request's CPU-heavy work, off the event loop and within a time budget.

The gateway has one event loop: while it renders a chat template or tokenizes a long
prompt, nothing else runs (not /health, not the instances' outputs, not the heartbeat
watcher, which could then take live instances for dead). So chat templates render and
prompts tokenize in worker threads (the Rust tokenizer releases the GIL), and the
request waits at most `budget_s` for them: then it gets a 400 (the thread, which cannot
be interrupted, finishes on its own; the server's template and a prompt already cut to
the context's size bound it). A template the request brings renders in a killable child
process (`template_sandbox.py`).

A prompt's characters bound its tokens from below (no token is longer than the
vocabulary's longest), so a text that cannot fit `max_model_len` is refused before it is
tokenized at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pdserve.gateway.errors import APIError, bad_request
from pdserve.gateway.template_sandbox import (
    RenderJob,
    RenderTimeout,
    RenderUnavailable,
    TemplateSandbox,
)
from pdserve.text.tokenizer import Tokenizer, TokenizerError

T = TypeVar("T")
DEFAULT_BUDGET_S = 10.0
MAX_RENDERED_CHARS = 64 << 20  # a request template's output, whatever the context


class Offload:
    def __init__(self, tokenizer: Tokenizer, budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.tokenizer = tokenizer
        self.budget_s = budget_s
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdserve-cpu")
        # Threads that wait on sandboxed renders are apart: slow request templates never
        # hold the threads every other request tokenizes in.
        self._sandbox = TemplateSandbox(max_concurrent=2)
        self._sandbox_threads = ThreadPoolExecutor(4, thread_name_prefix="pdserve-sandbox")
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        self.max_token_chars = max((len(token) for token in vocab), default=1) or 1

    def close(self) -> None:
        self._sandbox.close()
        for pool in (self._threads, self._sandbox_threads):
            pool.shutdown(wait=False, cancel_futures=True)

    def max_chars(self, max_tokens: int) -> int:
        """The longest text that could still be at most `max_tokens` tokens."""
        return max_tokens * self.max_token_chars

    async def encode(
        self, text: str, add_special_tokens: bool, max_tokens: int, param: str
    ) -> list[int]:
        if len(text) > self.max_chars(max_tokens):
            at_least = -(-len(text) // self.max_token_chars)
            raise bad_request(
                f"This model's maximum context length is {max_tokens} tokens, but the "
                f"prompt has at least {at_least} tokens. Please shorten the {param}.",
                param=param,
                code="context_length_exceeded",
            )
        work = lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)  # noqa: E731
        return await self.run(work, "tokenizing the prompt", param)

    async def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        template: str | None,
        add_generation_prompt: bool,
        tools: list[Any] | None,
        variables: dict[str, Any],
        max_tokens: int,
        from_request: bool = False,
    ) -> str:
        """The chat prompt as text: a server's template (`template`, else the tokenizer's
        default) in a thread, or one the request brought (`from_request`) in a killable
        child process. A template that fails is a 400."""
        if not from_request or template is None:
            tokenizer = self.tokenizer

            def work() -> str:
                return tokenizer.apply_chat_template(
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    chat_template=template,
                    **variables,
                )

            return await self.run(work, "rendering the chat template", "messages")
        documents = variables.pop("documents", None)
        job = RenderJob(
            template=template,
            messages=[dict(m) for m in conversation],
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            variables={**self.tokenizer.special_tokens, **variables},
            max_chars=min(MAX_RENDERED_CHARS, self.max_chars(max_tokens)),
        )
        budget = self.budget_s
        work = lambda: self._sandbox_render(job, budget)  # noqa: E731
        # The child is killed at the budget; the extra second is for the fork and the kill.
        return await self.run(
            work, "rendering the chat template", "messages", budget + 1.0, self._sandbox_threads
        )

    def _sandbox_render(self, job: RenderJob, budget_s: float) -> str:
        try:
            return self._sandbox.render(job, budget_s)
        except RenderTimeout:
            raise _over_budget("rendering the chat template", budget_s, "messages") from None
        except RenderUnavailable as exc:
            raise APIError(
                503,
                "cannot render the request's chat template now",
                code="unavailable",
                headers={"Retry-After": "1"},
            ) from exc

    async def run(
        self,
        work: Callable[[], T],
        what: str,
        param: str,
        budget_s: float | None = None,
        pool: ThreadPoolExecutor | None = None,
    ) -> T:
        """`work` in a worker thread; a 400 if it takes over the budget or fails."""
        budget = self.budget_s if budget_s is None else budget_s
        future = asyncio.get_running_loop().run_in_executor(pool or self._threads, work)
        try:
            return await asyncio.wait_for(future, budget)
        except TimeoutError:
            raise _over_budget(what, self.budget_s, param) from None
        except TokenizerError as exc:
            raise bad_request(str(exc), param=param) from None
        except RecursionError:  # data nested deep enough to exhaust the stack on the way
            raise bad_request(f"{what} failed: the input is nested too deeply", param) from None


def _over_budget(what: str, budget_s: float, param: str):
    return bad_request(
        f"{what} took longer than its budget of {budget_s:g} s", param=param, code="budget_exceeded"
    )
