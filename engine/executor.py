"""The seam between a driver (an instance's step loop, or the offline `LLM`) and the
ranks that hold the model: load, run a planned step, shut down.

Only `engine.step_plan` messages cross it. `InProcessExecutor` runs one rank in this
process; worker groups (tensor/pipeline parallel ranks in other processes) implement
the same protocol, so neither the step loop nor the scheduler changes with them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.common.structured_output import StructuredOutput
from pdserve.engine.config import EngineConfig
from pdserve.engine.devices import use_device
from pdserve.engine.step_plan import KVGeometry, StepPlan, StepResult, WorkerInfo

if TYPE_CHECKING:
    from pdserve.engine.worker import ModelWorker


class RankConnector(Protocol):
    """The worker half of a KV connector, one per rank (e.g. a KV transfer worker):
    it starts once the rank's KV cache exists, gets each plan's connector metadata
    before the step runs and reports its finished and failed transfers after."""

    def start(self, storage: Any, geometry: KVGeometry) -> str:
        """Starts serving the rank's KV storage (a tensor); returns its endpoint."""
        ...

    def apply(self, metadata: Any) -> None: ...

    def report(self) -> Any: ...

    def close(self) -> None: ...


# (tp_rank, tp_size) → the rank's connector, built where the rank runs. A factory may
# name `metadata_type` and `report_type`: what its messages decode to across processes.
ConnectorFactory = Callable[[int, int], RankConnector]


class Executor(Protocol):
    def load(self) -> WorkerInfo:
        """Loads the weights and the KV cache on every rank (slow)."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one planned step; a plan without chunks only exchanges KV metadata."""
        ...

    def prepare_grammar(self, spec: StructuredOutput) -> Future[Any]:
        """Starts compiling a structured-output constraint on the ranks; the future is
        done once every rank holds it (it fails with a one-line reason)."""
        ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """One rank, in the driver's process and thread."""

    def __init__(self, config: EngineConfig, connector: RankConnector | None = None) -> None:
        self.config = config
        self.connector = connector
        self.worker: ModelWorker | None = None

    def load(self) -> WorkerInfo:
        from pdserve.engine.worker import ModelWorker  # torch loads here, not at import

        use_device(self.config.device)  # "cuda:1": kernels launch on the current device
        self.worker = ModelWorker(self.config, self.connector)
        return self.worker.load()

    def execute(self, plan: StepPlan) -> StepResult:
        if self.worker is None:
            raise RuntimeError("the executor is not loaded yet: call load() first")
        return self.worker.execute(plan)

    def prepare_grammar(self, spec: StructuredOutput) -> Future[Any]:
        if self.worker is None:
            raise RuntimeError("the executor is not loaded yet: call load() first")
        return self.worker.prepare_grammar(spec)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
