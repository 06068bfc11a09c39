"""Moving KV-cache blocks from a prefill instance to a decode instance.

The roles' halves of the connector live with them (`prefill/kv_scheduler.py`,
`decode/kv_scheduler.py`); here: what moves the bytes. Worker half (one per TP rank):
`KVTransferWorker`; on the driver, `ReportAggregator` and `KVLink`. Messages:
`KVHandoff` (P → D), `KVConnectorMetadata` (driver → ranks), `TransferReport`
(ranks → driver). See README.md in this folder for the protocol.
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
from pdserve.kvtransfer.reports import ReportAggregator
from pdserve.kvtransfer.worker import KVTransferWorker

__all__ = [
    "FAILURE_POLICIES",
    "SECONDS_BUCKETS",
    "KVConnectorMetadata",
    "KVHandoff",
    "KVLayout",
    "KVLayoutMismatch",
    "KVSource",
    "KVTransferConfig",
    "KVTransferStats",
    "KVTransferWorker",
    "ReportAggregator",
    "TransferReport",
    "layout_of",
]
