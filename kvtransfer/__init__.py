"""Moving KV-cache blocks from a prefill instance to a decode instance.

Scheduler half (one per instance): `PrefillKVScheduler`, `DecodeKVScheduler`,
`ReportAggregator`. Worker half (one per TP rank): `KVTransferWorker`. Messages:
`KVHandoff` (P → D), `KVConnectorMetadata` (leader → ranks), `TransferReport`
(ranks → leader). See README.md in this folder for the protocol.
"""

from pdserve.kvtransfer.config import FAILURE_POLICIES, KVTransferConfig
from pdserve.kvtransfer.layout import KVLayoutMismatch, layout_of
from pdserve.kvtransfer.messages import (
    KVConnectorMetadata,
    KVHandoff,
    KVLayout,
    KVSource,
    TransferReport,
)
from pdserve.kvtransfer.metrics import SECONDS_BUCKETS, KVTransferStats
from pdserve.kvtransfer.scheduler_side import (
    DecodeKVScheduler,
    DecodeUpdate,
    PrefillKVScheduler,
    PrefillUpdate,
    RemoteKVFailure,
    ReportAggregator,
)
from pdserve.kvtransfer.worker import KVTransferWorker

__all__ = [
    "FAILURE_POLICIES",
    "SECONDS_BUCKETS",
    "DecodeKVScheduler",
    "DecodeUpdate",
    "KVConnectorMetadata",
    "KVHandoff",
    "KVLayout",
    "KVLayoutMismatch",
    "KVSource",
    "KVTransferConfig",
    "KVTransferStats",
    "KVTransferWorker",
    "PrefillKVScheduler",
    "PrefillUpdate",
    "RemoteKVFailure",
    "ReportAggregator",
    "TransferReport",
    "layout_of",
]
