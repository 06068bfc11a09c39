"""What a decode instance's task socket accepts: the gateway's tasks and the prefill
instances' handoffs. The union lives here, not in `pdserve.common.messages`, so the wire
protocol of the scheduler room stays free of kvtransfer (and of torch)."""

from __future__ import annotations

from pdserve.common.messages import Task
from pdserve.kvtransfer import KVHandoff

DecodeTask = Task | KVHandoff

__all__ = ["DecodeTask", "KVHandoff"]
