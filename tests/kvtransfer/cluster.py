"""The test process as the instances' drivers: scheduler halves and block accounting.

`Instance` pairs a child `Peer` (the TP ranks, with real workers and KV memory) with
what the instance's driver would own: a `PrefillKVScheduler` or `DecodeKVScheduler`,
a `ReportAggregator`, and `BlockPool`, a small stand-in for the block manager that
hands out non-contiguous block ids and checks that every block comes back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from pdserve.common.sampling_params import SamplingParams
from pdserve.decode.kv_scheduler import DecodeKVScheduler, DecodeUpdate
from pdserve.kvtransfer import (
    KVHandoff,
    KVLayout,
    ReportAggregator,
    TransferReport,
)
from pdserve.prefill.kv_scheduler import PrefillKVScheduler, PrefillUpdate
from tests.kvtransfer.peer import Peer


class BlockPool:
    """Free-list accounting; allocations come out in short runs in shuffled order."""

    def __init__(self, num_blocks: int, seed: int = 0):
        rng = random.Random(seed)
        ids = list(range(num_blocks))
        segments, start = [], 0
        while start < num_blocks:
            length = rng.randint(1, 6)
            segments.append(ids[start : start + length])
            start += length
        rng.shuffle(segments)
        self.num_blocks = num_blocks
        self._free = [b for segment in segments for b in segment]
        self._owned: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, owner: str, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"pool exhausted: {count} wanted, {len(self._free)} free")
        blocks, self._free = self._free[:count], self._free[count:]
        self._owned[owner] = blocks
        return blocks

    def owns(self, owner: str) -> bool:
        return owner in self._owned

    def blocks_of(self, owner: str) -> list[int]:
        return self._owned[owner]

    def free(self, owner: str) -> list[int]:
        blocks = self._owned.pop(owner)
        self._free.extend(blocks)
        return blocks


@dataclass
class Instance:
    peer: Peer
    name: str
    layout: KVLayout
    tp_size: int
    addresses: list[str]
    pool: BlockPool
    prefill: PrefillKVScheduler | None = None
    decode: DecodeKVScheduler | None = None
    aggregator: ReportAggregator = field(init=False)

    def __post_init__(self) -> None:
        self.aggregator = ReportAggregator(self.tp_size)

    @classmethod
    def start(
        cls,
        peer: Peer,
        name: str,
        role: str,
        layout: KVLayout,
        num_blocks: int,
        config: dict[str, Any],
        tp_size: int = 1,
        seed: int = 1,
        backend: str = "numpy",
        policy: str = "recompute",
    ) -> Instance:
        """A prefill instance's KV is random bytes from `seed`; a decode one's is zero."""
        spec = {
            "layout": msgspec.structs.asdict(layout),
            "tp_size": tp_size,
            "num_blocks": num_blocks,
            "seed": seed if role == "prefill" else None,
            "backend": backend,
            "config": {"instance_id": name, **config},
        }
        addresses = peer.call("start", name, spec, timeout=120)
        instance = cls(peer, name, layout, tp_size, addresses, BlockPool(num_blocks, seed))
        if role == "prefill":
            instance.prefill = PrefillKVScheduler(name, layout, addresses)
        else:
            instance.decode = DecodeKVScheduler(layout, tp_size, policy)
        return instance

    def push(self) -> None:
        """Hand this step's scheduler-half metadata to every rank."""
        half = self.prefill or self.decode
        assert half is not None
        metadata = half.build_metadata()
        if not metadata.is_empty:
            for rank in range(self.tp_size):
                self.peer.apply(self.name, rank, metadata)

    def poll(self) -> TransferReport:
        for rank in range(self.tp_size):
            raw = self.peer.call("reports", self.name, rank)
            self.aggregator.add(rank, msgspec.convert(raw, TransferReport))
        return self.aggregator.pop()

    def stats(self, rank: int = 0) -> dict[str, Any]:
        return self.peer.call("stats", self.name, rank)

    def digests(self, block_ids: list[int]) -> list[list[str]]:
        """Per block: sha256 of every global kv head (all layers, K and V)."""
        per_rank = [self.peer.call("digests", self.name, r, block_ids) for r in range(self.tp_size)]
        return [[h for rank in per_rank for h in rank[i]] for i in range(len(block_ids))]


def hand_off(p: Instance, d: Instance, request_id: str, num_tokens: int) -> KVHandoff:
    """P finished a prompt of `num_tokens`: hold its blocks for `d` (in epoch 0, the
    epoch of its scheduler half); the handoff crosses a wire."""
    assert p.prefill is not None
    count = -(-num_tokens // p.layout.block_size)
    blocks = p.pool.allocate(request_id, count)
    request = SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=list(range(num_tokens)),
        sampling_params=SamplingParams(max_tokens=8),
        eos_token_ids=frozenset({2}),
        cache_salt="tenant-a",
        seed=7,
    )
    handoff = p.prefill.hand_off(request, blocks, 42, -0.5, decode_id=d.name, decode_epoch=0)
    p.push()
    return msgspec.msgpack.decode(msgspec.msgpack.encode(handoff), type=KVHandoff)


def admit_and_pull(d: Instance, handoff: KVHandoff, cached_tokens: int = 0) -> list[int]:
    """D admits the handoff, allocates blocks and starts the pull; returns its blocks."""
    assert d.decode is not None
    num_tokens = d.decode.admit(handoff)
    blocks = d.pool.allocate(handoff.request_id, -(-num_tokens // d.layout.block_size))
    allocation = SimpleNamespace(
        request_id=handoff.request_id, block_ids=blocks, num_local_cached_tokens=cached_tokens
    )
    d.decode.on_allocation(allocation)
    d.push()
    return blocks


@dataclass
class Outcomes:
    prefill: PrefillUpdate = field(default_factory=PrefillUpdate)
    decode: DecodeUpdate = field(default_factory=DecodeUpdate)

    def add_prefill(self, update: PrefillUpdate) -> None:
        self.prefill.released += update.released
        self.prefill.expired += update.expired
        self.prefill.aborted += update.aborted

    def add_decode(self, update: DecodeUpdate) -> None:
        self.decode.ready += update.ready
        self.decode.failed += update.failed
        self.decode.aborted += update.aborted


def step(p: Instance | None, d: Instance | None, outcomes: Outcomes) -> Outcomes:
    """One driver step on each side: collect reports, act on them like an instance.
    P frees whatever is released/expired/aborted; D frees failed and aborted requests
    (ready ones keep their blocks until the test checks and frees them)."""
    if p is not None and p.prefill is not None:
        update = p.prefill.update(p.poll())
        for rid in update.released + update.expired + update.aborted:
            p.pool.free(rid)
        outcomes.add_prefill(update)
    if d is not None and d.decode is not None:
        update = d.decode.update(d.poll())
        for rid in [f.request_id for f in update.failed] + update.aborted:
            if d.pool.owns(rid):  # a request can fail before it was allocated
                d.pool.free(rid)
        outcomes.add_decode(update)
    return outcomes


def run_until(
    p: Instance | None, d: Instance | None, done: Any, timeout: float, interval: float = 0.01
) -> Outcomes:
    """Step both sides until `done(outcomes)`; TimeoutError (with what happened) if not."""
    import time

    outcomes = Outcomes()
    deadline = time.monotonic() + timeout
    while not done(outcomes):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not done within {timeout}s: {outcomes}")
        step(p, d, outcomes)
        time.sleep(interval)
    return outcomes
