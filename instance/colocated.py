"""The colocated role: an ordinary engine that runs each request to the end.

It computes the prompt and every output token itself — the baseline disaggregated
serving is compared against, and the whole of `--mode colocated`. It adds nothing to
the step loop.
"""

from __future__ import annotations

from typing import Any

from pdserve.common.messages import (
    AbortTask,
    GenerateTask,
    InstanceStats,
    MetricsDelta,
    RequestDelta,
)
from pdserve.engine.core import EngineCore

GRAMMAR_POLL_S = 0.005


class ColocatedRole:
    def __init__(self, instance_id: str, engine: EngineCore) -> None:
        self.instance_id = instance_id
        self.engine = engine

    def admit(self, task: GenerateTask, received_at: float | None = None) -> None:
        self.engine.add_request(self.engine.request_of(task, received_at))

    def on_task(self, task: Any, received_at: float | None = None) -> RequestDelta | None:
        raise TypeError(f"a colocated instance has no {type(task).__name__} tasks")  # never decoded

    def request_ids(self) -> set[str]:
        return self.engine.request_ids()

    def abort(self, task: AbortTask) -> None:
        for request_id in task.request_ids:
            self.engine.abort_request(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def task_wait_s(self, idle_wait_s: float) -> float:
        if self.engine.scheduler.has_unfinished_requests():
            return 0.0
        # Only grammars compiling: look again soon, without spinning.
        return GRAMMAR_POLL_S if self.has_work() else idle_wait_s

    def before_step(self) -> None:
        pass

    def step(self) -> list[RequestDelta]:
        return self.engine.step()

    def after_step(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        return deltas

    def has_news(self) -> bool:
        return False

    def add_metrics(self, metrics: MetricsDelta) -> None:
        pass

    def add_stats(self, stats: InstanceStats) -> None:
        pass
