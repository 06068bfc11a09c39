"""`pdserve serve` processes for the slow end-to-end modules, one per module."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.gateway.server import ServeProcess

MODEL = "SmolLM2-135M-Instruct"  # the embedded model, what a server with no --model serves
# Local processes, one torch thread each (the machine is shared), test hooks on.
LOCAL = ("--launcher", "local", "--threads-per-instance", "1", "--enable-test-hooks")


@contextmanager
def served(
    *args: str,
    clean: bool = False,
    exit_zero: bool = False,
    stop_timeout_s: float = 30.0,
    **start: Any,
) -> Iterator[ServeProcess]:
    """A server started with `args` for the block, stopped after. With `clean`, every
    block must end free or cached and the server must exit 0; with `exit_zero`, only
    the latter."""
    process = ServeProcess.start(*args, **start)
    try:
        yield process
        if clean:
            process.assert_blocks_free_or_cached()
    finally:
        code = process.stop(timeout_s=stop_timeout_s)
        if clean or exit_zero:
            assert code == 0, f"pdserve serve exited with {code}:\n{process.log()}"
