"""Questions to instances about their books (`InspectTask`), answered in a later output.

Each question is a future keyed by (instance, query id): the output that carries the
inspection answers it, an instance taken for dead answers None for itself.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable

from pdserve.common.messages import InspectTask, InstanceInspection, Task


class Inspections:
    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], asyncio.Future] = {}

    async def ask(
        self, instance_ids: Iterable[str], send: Callable[[str, Task], bool], timeout_s: float
    ) -> dict[str, InstanceInspection | None]:
        """Every instance's books (None for one that did not answer in time)."""
        query_id = uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        futures: dict[str, asyncio.Future] = {}
        for instance_id in instance_ids:
            future = loop.create_future()
            self._pending[(instance_id, query_id)] = future
            futures[instance_id] = future
            send(instance_id, InspectTask(query_id))
        try:
            if futures:
                await asyncio.wait(futures.values(), timeout=timeout_s)
        finally:
            for instance_id in futures:
                self._pending.pop((instance_id, query_id), None)
        return {i: f.result() if f.done() else None for i, f in futures.items()}

    def answer(self, instance_id: str, inspection: InstanceInspection) -> None:
        future = self._pending.get((instance_id, inspection.query_id))
        if future is not None and not future.done():
            future.set_result(inspection)

    def forget(self, instance_id: str) -> None:
        """The instance is gone: its questions are answered with None."""
        for (owner, _), future in list(self._pending.items()):
            if owner == instance_id and not future.done():
                future.set_result(None)
