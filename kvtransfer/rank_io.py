"""What the two halves of a TP rank's KV-transfer I/O thread share: the rank's place in
its instance, its KV memory and transport, and the stats both count into."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.kv_memory import KVMemory
from pdserve.kvtransfer.layout import head_range
from pdserve.kvtransfer.messages import KVLayout
from pdserve.kvtransfer.metrics import KVTransferStats
from pdserve.kvtransfer.transport import Transport


@dataclass
class RankIO:
    config: KVTransferConfig
    layout: KVLayout
    tp_rank: int
    tp_size: int
    memory: KVMemory
    transport: Transport
    stats: KVTransferStats
    pp_stage: int = 0  # a rank of stage s serves and pulls stage s's layers only

    @property
    def heads(self) -> tuple[int, int]:
        """The global kv heads this rank holds, [start, end)."""
        return head_range(self.layout, self.tp_rank, self.tp_size)

    def introduction(self) -> tuple[str, int, int, KVLayout, str]:
        """Who this rank is, as a handshake (`Hello`, `HelloReply`) starts."""
        return (
            self.config.instance_id,
            self.tp_rank,
            self.tp_size,
            self.layout,
            self.transport.name,
        )


class RankHalf:
    """Base of the serving and the pulling half: the rank's parts under short names."""

    def __init__(self, rank: RankIO):
        self._config, self._layout = rank.config, rank.layout
        self._tp_rank, self._tp_size = rank.tp_rank, rank.tp_size
        self._memory, self._transport, self._stats = rank.memory, rank.transport, rank.stats
        self._heads = rank.heads
        self._pp_stage = rank.pp_stage
        self._rank = rank
