"""Routing policies of the global scheduler: which instance of a pool takes a request.

Every policy answers three questions behind one interface: which prefill instance
computes a prompt, which decode instance continues it, and — when a request runs
whole on one instance (colocated mode, or a prompt that skips the prefill pool) —
which of the decode-capable instances takes it. `PrefillSkipDecider` says when a
prompt may skip the prefill pool.

Load figures combine what an instance last reported (`InstanceStats`, which lags by a
step) with what the gateway itself sent since (exact), so a burst of requests spreads
out instead of piling onto whichever instance looked emptiest a moment ago.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pdserve.common.block_events import BlockEventBatch, CachedHashMirror
from pdserve.common.messages import InstanceInfo, InstanceStats
from pdserve.scheduler.block_hash import BlockHash, extra_keys_for, hash_full_blocks

ROLES_THAT_DECODE = ("decode", "colocated")
MAX_UNSYNCED_BATCHES = 256  # block-event batches kept while a snapshot is awaited


@dataclass
class RouteRequest:
    """What routing needs of a request: its prompt and tenant (for prefix hashes)."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str = ""
    _hashes: dict[int, list[BlockHash]] = field(default_factory=dict, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        """The prompt's full-block hashes as an instance with this block size keys them."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            extra = extra_keys_for(self.cache_salt)
            hashes = hash_full_blocks(self.prompt_token_ids, block_size, extra)
            self._hashes[block_size] = hashes
        return hashes

    def num_blocks(self, block_size: int) -> int:
        return -(-self.num_prompt_tokens // block_size)


@dataclass
class InstanceView:
    """The global scheduler's picture of one instance."""

    info: InstanceInfo
    last_seen: float
    # When its step loop last completed a turn, as its outputs' `loop_turns` tell.
    turned_at: float = 0.0
    loop_turns: int = 0
    stats: InstanceStats = field(default_factory=InstanceStats)
    mirror: CachedHashMirror = field(default_factory=CachedHashMirror)
    unsynced_batches: list[BlockEventBatch] = field(default_factory=list)
    alive: bool = True
    # The instance's current life: bumped when it is taken for dead (its epoch retired),
    # so whatever it sent from its former life is told apart and dropped; its
    # replacement starts in this epoch.
    epoch: int = 0
    # An operator drains it: routing sends it nothing new; once `in_flight` is empty the
    # cluster stops it (`gateway/admin.py`).
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)  # requests assigned here, not finished
    # Prompt tokens of requests sent here for their prefill that have no first token yet.
    unstarted_tokens: dict[str, int] = field(default_factory=dict)
    # Blocks the requests sent since the last stats will take (stats do not show them yet).
    pending_blocks: int = 0

    def __post_init__(self) -> None:
        if not self.stats.num_total_blocks:
            self.stats = InstanceStats(
                num_free_blocks=self.info.num_blocks, num_total_blocks=self.info.num_blocks
            )

    @property
    def instance_id(self) -> str:
        return self.info.address.instance_id

    @property
    def role(self) -> str:
        return self.info.address.role

    @property
    def block_size(self) -> int:
        return self.info.block_size

    def queued_prefill_tokens(self) -> int:
        return max(self.stats.queued_prefill_tokens, sum(self.unstarted_tokens.values()))

    def estimated_free_blocks(self) -> int:
        return self.stats.num_free_blocks - self.pending_blocks

    def cached_prefix_tokens(self, request: RouteRequest) -> int:
        """Prompt tokens this instance holds in its prefix cache (per its block events)."""
        hashes = request.block_hashes(self.block_size)
        return self.mirror.count_cached_prefix(hashes) * self.block_size


class RoutingPolicy(ABC):
    """Picks one instance among live candidates (never an empty list)."""

    name: ClassVar[str]

    @abstractmethod
    def pick_prefill(
        self, candidates: Sequence[InstanceView], request: RouteRequest
    ) -> InstanceView:
        """The prefill instance that computes the prompt and samples the first token."""

    @abstractmethod
    def pick_decode(
        self, candidates: Sequence[InstanceView], request: RouteRequest
    ) -> InstanceView:
        """The decode instance that continues after the first token."""

    @abstractmethod
    def pick_colocated(
        self, candidates: Sequence[InstanceView], request: RouteRequest
    ) -> InstanceView:
        """The instance that runs the whole request, prompt included."""


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turns = {pool: itertools.count() for pool in ("prefill", "decode", "colocated")}

    def _next(self, pool: str, candidates: Sequence[InstanceView]) -> InstanceView:
        ordered = sorted(candidates, key=lambda view: view.instance_id)
        return ordered[next(self._turns[pool]) % len(ordered)]

    def pick_prefill(self, candidates, request):
        return self._next("prefill", candidates)

    def pick_decode(self, candidates, request):
        return self._next("decode", candidates)

    def pick_colocated(self, candidates, request):
        return self._next("colocated", candidates)


class LoadAwarePolicy(RoutingPolicy):
    """Prefill: the fewest prompt tokens queued. Decode: the most free KV blocks, then
    the fewest requests in flight. Colocated: queued prompt tokens, then requests."""

    name = "load_aware"

    def pick_prefill(self, candidates, request):
        return min(
            candidates, key=lambda v: (v.queued_prefill_tokens(), len(v.in_flight), v.instance_id)
        )

    def pick_decode(self, candidates, request):
        return min(
            candidates,
            key=lambda v: (-v.estimated_free_blocks(), len(v.in_flight), v.instance_id),
        )

    def pick_colocated(self, candidates, request):
        return min(
            candidates,
            key=lambda v: (
                v.queued_prefill_tokens(),
                len(v.in_flight),
                -v.estimated_free_blocks(),
                v.instance_id,
            ),
        )


class PrefixAwarePolicy(LoadAwarePolicy):
    """Prefill (and colocated): the instance that would finish this prompt's prefill
    first, counting the tokens queued ahead of it and the part of the prompt it still
    has to compute — so the longest cached prefix wins among equally loaded
    instances, and a hot prefix does not pile every request onto one instance.
    Decode: load-aware."""

    name = "prefix_aware"

    def pick_prefill(self, candidates, request):
        return min(candidates, key=lambda v: self._prefill_cost(v, request))

    def pick_colocated(self, candidates, request):
        return min(candidates, key=lambda v: self._prefill_cost(v, request))

    @staticmethod
    def _prefill_cost(view: InstanceView, request: RouteRequest) -> tuple[int, int, int, str]:
        cached = view.cached_prefix_tokens(request)
        work = view.queued_prefill_tokens() + request.num_prompt_tokens - cached
        return (work, -cached, len(view.in_flight), view.instance_id)


POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobinPolicy, LoadAwarePolicy, PrefixAwarePolicy)
}
# `pdserve serve`'s default and the library's: prompts that share a prefix go where it is cached.
DEFAULT_POLICY = "prefix_aware"


def make_policy(name: str) -> RoutingPolicy:
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return policy()


@dataclass(frozen=True)
class PrefillSkipDecider:
    """Lets a prompt skip the prefill pool and be prefilled on its decode instance.

    Short prompts cost a decode batch little, and a prompt mostly cached on the decode
    instance leaves little to compute there, while a handoff costs a transfer either
    way. 0 turns a threshold off.
    """

    max_prompt_tokens: int = 0  # prompts this short (or shorter) skip
    min_cached_ratio: float = 0.0  # prompts cached on the decode instance this much skip

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0, got {self.max_prompt_tokens}")
        if not 0.0 <= self.min_cached_ratio <= 1.0:
            raise ValueError(f"min_cached_ratio must be in [0, 1], got {self.min_cached_ratio}")

    def should_skip(self, request: RouteRequest, decode: InstanceView) -> bool:
        if self.max_prompt_tokens and request.num_prompt_tokens <= self.max_prompt_tokens:
            return True
        if self.min_cached_ratio and request.num_prompt_tokens:
            ratio = decode.cached_prefix_tokens(request) / request.num_prompt_tokens
            return ratio >= self.min_cached_ratio
        return False
