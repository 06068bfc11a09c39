"""Where a request waits while its structured-output grammar compiles.

Compiling happens on the ranks, off the step loop (`Executor.prepare_grammar`). Until its
grammar is ready a request stays out of the scheduler (it holds no seat and no blocks, and
the step loop goes on for everyone else); once ready it enters the scheduler the way its
owner asked (`enter`); if compiling fails or runs past the time budget it ends in an error
naming the reason. Torch-free: the driver side of the executor seam.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pdserve.common.request import Request
from pdserve.common.structured_output import StructuredOutput


@dataclass
class _Waiting:
    request: Request
    compiled: Future[Any]
    enter: Callable[[], None]
    since: float


class GrammarGate:
    def __init__(
        self,
        prepare: Callable[[StructuredOutput], Future[Any]],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prepare = prepare
        self.timeout_s = timeout_s
        self.clock = clock
        self._waiting: dict[str, _Waiting] = {}

    def admit(self, request: Request, enter: Callable[[], None]) -> None:
        """Enters the request now, or once its grammar has compiled."""
        spec = request.sampling_params.structured_outputs
        if spec is None:
            enter()
            return
        compiled = self.prepare(spec)
        if compiled.done() and compiled.exception() is None:
            enter()
            return
        self._waiting[request.request_id] = _Waiting(request, compiled, enter, self.clock())

    def poll(self) -> list[tuple[Request, str]]:
        """Enters every request whose grammar is ready; returns those that failed (the
        request and why), which are dropped here."""
        failed = []
        now = self.clock()
        for request_id, waiting in list(self._waiting.items()):
            if waiting.compiled.done():
                del self._waiting[request_id]
                error = waiting.compiled.exception()
                if error is None:
                    waiting.enter()
                else:
                    failed.append((waiting.request, str(error)))
            elif now - waiting.since > self.timeout_s:
                del self._waiting[request_id]
                failed.append(
                    (
                        waiting.request,
                        f"the structured-output grammar did not compile within "
                        f"{self.timeout_s:g} s",
                    )
                )
        return failed

    def abort(self, request_id: str) -> bool:
        return self._waiting.pop(request_id, None) is not None

    def request_ids(self) -> set[str]:
        return set(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)
