"""Chat templates a request brings, rendered in a child process that can be killed.

jinja's sandbox stops a template from reaching Python internals, not from looping for
hours (`{% for i in range(99999) %}{% for j in range(99999) %}`) or building a string of
gigabytes. A thread cannot be interrupted, so such a template is rendered in a child
process forked from a fork server (which has the template code loaded already, so a
render costs a fork, not an interpreter start): over its time budget the child is
killed; its address space is capped, so a memory bomb fails there instead of in the
gateway; its output is capped too. Messages cross as msgpack, never pickle.

Only `--trust-request-chat-template` lets request templates reach this at all.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import resource
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from pdserve.text.tokenizer import TokenizerError, render_chat_template

# Address space a render may add to the child's (the fork server's copy of jinja and
# tokenizers is already mapped): a template allocating more fails with MemoryError.
MEMORY_BUDGET_BYTES = 512 << 20


class RenderJob(msgspec.Struct, kw_only=True):
    template: str
    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    tools: list[Any] | None
    documents: list[Any] | None
    variables: dict[str, Any]
    max_chars: int  # longer output is refused in the child, never shipped back


class RenderResult(msgspec.Struct, kw_only=True):
    text: str | None = None
    error: str | None = None


class RenderTimeout(Exception):
    """The child ran past its budget and was killed."""


class RenderUnavailable(Exception):
    """No child could be started (a server fault, not the template's)."""


@dataclass
class TemplateSandbox:
    """Renders request templates in killable children, at most `max_concurrent` at once."""

    max_concurrent: int = 2

    def __post_init__(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_concurrent)
        self._context: Any = None
        self._lock = threading.Lock()
        self._live: set[Any] = set()  # children rendering now: killed on close
        self._closed = False

    def render(self, job: RenderJob, budget_s: float) -> str:
        """Blocking (call it from a worker thread): the rendered text, or TokenizerError
        for a template that fails, or RenderTimeout past `budget_s` (waiting included)."""
        if not self._slots.acquire(timeout=budget_s):
            raise RenderTimeout
        try:
            return self._render_in_child(job, budget_s)
        finally:
            self._slots.release()

    def _render_in_child(self, job: RenderJob, budget_s: float) -> str:
        parent, child = self._mp().Pipe()
        process = self._mp().Process(target=_child_main, args=(child,), daemon=True)
        with self._lock:
            if self._closed:
                raise RenderUnavailable("the server is shutting down")
            try:
                process.start()
            except (OSError, RuntimeError) as exc:
                parent.close()
                child.close()
                raise RenderUnavailable(f"{type(exc).__name__}: {exc}") from None
            self._live.add(process)
        child.close()
        try:
            parent.send_bytes(msgspec.msgpack.encode(job))
            if not parent.poll(budget_s):
                raise RenderTimeout
            result = msgspec.msgpack.decode(parent.recv_bytes(), type=RenderResult)
        except (EOFError, OSError, msgspec.DecodeError):
            # The child died (out of memory, or killed): the template is at fault.
            raise TokenizerError("chat template failed: the render process died") from None
        finally:
            parent.close()
            with self._lock:
                self._live.discard(process)
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
            with contextlib.suppress(ValueError):
                process.close()
        if result.error is not None:
            raise TokenizerError(result.error)
        return result.text or ""

    def close(self) -> None:
        """Kills the renders under way (their requests see a dead child): shutting down
        never waits for a template."""
        with self._lock:
            self._closed = True
            for process in self._live:
                with contextlib.suppress(Exception):
                    process.kill()

    def _mp(self) -> Any:
        with self._lock:
            if self._context is None:
                # Never fork the gateway itself (threads, sockets, an event loop): a fork
                # server started fresh, with only the template code preloaded.
                self._context = multiprocessing.get_context("forkserver")
                self._context.set_forkserver_preload([__name__])
            return self._context


def _child_main(conn: Connection) -> None:
    _cap_memory(MEMORY_BUDGET_BYTES)
    try:
        job = msgspec.msgpack.decode(conn.recv_bytes(), type=RenderJob)
        text = render_chat_template(
            job.template,
            job.messages,
            job.add_generation_prompt,
            job.tools,
            job.documents,
            **job.variables,
        )
        if len(text) > job.max_chars:
            result = RenderResult(
                error=f"the chat template's output exceeds {job.max_chars} characters"
            )
        else:
            result = RenderResult(text=text)
    except TokenizerError as exc:
        result = RenderResult(error=str(exc))
    except (MemoryError, RecursionError) as exc:
        result = RenderResult(error=f"chat template failed: {type(exc).__name__}")
    conn.send_bytes(msgspec.msgpack.encode(result))
    conn.close()


def _cap_memory(extra_bytes: int) -> None:
    """Address space: what is mapped now plus `extra_bytes` (Linux; elsewhere no cap)."""
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, mapped + extra_bytes))
    except (OSError, ValueError):
        pass
