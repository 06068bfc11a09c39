"""kvtransfer: moving KV-cache bytes from a prefill instance to a decode instance.

The roles' halves of the connector live with them (`prefill/kv_scheduler.py`,
`decode/kv_scheduler.py`; the rank-side halves `prefill/kv_server.py` and
`decode/kv_puller.py`); here, what moves the bytes:

- `worker.py`: `KVTransferWorker`, the transfer worker of each rank, and its I/O
  thread, into which the role hands its side (`rank_io.py`);
- `transport.py`: the UCX or ZMQ transports (one list of their names);
  `layout.py`: layouts and how head slices map between TP sizes; `device_order.py`:
  the order of a CUDA device's copies and steps against UCX;
- `control.py`: the control channel between two I/O threads (handshakes, pulls,
  lease renewals, aborts); `kv_memory.py`: one rank's KV storage seen as bytes;
  `metrics.py`: the transfer's counters;
- `messages.py`: `KVHandoff` (P → D), the connector metadata (driver → ranks),
  `TransferReport` (ranks → driver); `config.py`: `KVTransferConfig`, a msgspec Struct;
- `connector.py`: the rank's connector, and `link.py`: `KVLink`, the driver's end of
  it, shared by the prefill and decode roles; `reports.py`: `ReportAggregator`, a TP
  group's reports merged.

See README.md in this folder for the protocol.
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
