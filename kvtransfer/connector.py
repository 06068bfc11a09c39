"""The worker half of the KV connector as an executor rank sees it: one transfer worker
beside the rank's KV cache, fed the step's metadata and reporting what finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.layout import layout_of
from pdserve.kvtransfer.messages import KVConnectorMetadata, TransferReport
from pdserve.kvtransfer.metrics import KVTransferStats
from pdserve.kvtransfer.rank_io import PullingFactory, ServingFactory
from pdserve.kvtransfer.worker import KVTransferWorker


class RankReport(msgspec.Struct):
    """One rank's transfers finished since its last report, and its counters."""

    report: TransferReport
    stats: KVTransferStats


@dataclass(frozen=True)
class TransferConnectorFactory:
    """Builds each rank's connector where the rank runs (picklable, so a worker group's
    rank processes build their own); names the message types that cross the seam."""

    config: KVTransferConfig
    serve: ServingFactory | None = None  # the prefill role's side (`KVTransferWorker`)
    pull: PullingFactory | None = None  # the decode role's side
    metadata_type: ClassVar[type] = KVConnectorMetadata
    report_type: ClassVar[type] = RankReport

    def __call__(self, tp_rank: int = 0, tp_size: int = 1) -> TransferConnector:
        return TransferConnector(self.config, tp_rank, tp_size, self.serve, self.pull)


@dataclass(eq=False)
class TransferConnector:
    """Starts a `KVTransferWorker` over the rank's KV storage once the cache exists."""

    config: KVTransferConfig
    tp_rank: int = 0
    tp_size: int = 1
    serve: ServingFactory | None = None
    pull: PullingFactory | None = None
    worker: KVTransferWorker | None = field(default=None, init=False)

    def start(self, storage: Any, geometry: Any) -> str:
        """`geometry`: the rank's KV cache shape (block size, layers, kv heads on this
        rank, head dim, dtype); returns the control address peers hand-shake with."""
        layout = layout_of(geometry, self.tp_size)
        self.worker = KVTransferWorker(
            self.config,
            storage,
            layout,
            self.tp_rank,
            self.tp_size,
            pp_stage=getattr(geometry, "pipeline_stage", 0),
            stage_layers=geometry.num_layers,
            serve=self.serve,
            pull=self.pull,
        )
        self.worker.start()
        return self.worker.control_address

    def apply(self, metadata: KVConnectorMetadata) -> None:
        self._require_worker().apply(metadata)

    def report(self) -> RankReport:
        worker = self._require_worker()
        return RankReport(worker.get_finished(), worker.stats())

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def _require_worker(self) -> KVTransferWorker:
        if self.worker is None:
            raise RuntimeError("the KV connector is not started: the KV cache does not exist yet")
        return self.worker
