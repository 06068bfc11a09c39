"""The global scheduler: which instances serve a request, and what happens when one dies.

It lives in the gateway process and keeps a view of every instance (the stats and
heartbeats their outputs carry, their prefix caches mirrored from block events, the
requests the gateway sent them). For each request it admits or refuses (a bounded
queue beyond the running seats), then picks a route: a prefill instance and a decode
instance, or one instance that runs the whole request (colocated instances, or a
prompt that skips the prefill pool). When an instance dies, requests that still need
it are sent again elsewhere, up to `max_attempts` dispatches, then fail (a request whose
KV already reached its decode instance no longer needs its prefill instance). One that
already streamed tokens is migrated: the gateway sends it, with those tokens as its
output, to an instance that runs it to the end (`route(..., with_prefill=False)`).
An instance taken for dead never returns in its epoch: the cluster kills it and starts
a replacement in the next (`add_instance`).

Pure bookkeeping: no sockets, no clock of its own (callers pass `now`), no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.common.block_events import BlockCacheSnapshot, BlockEventBatch
from pdserve.common.messages import InstanceInfo, InstanceStats
from pdserve.gateway.routing import (
    DEFAULT_POLICY,
    MAX_UNSYNCED_BATCHES,
    ROLES_THAT_DECODE,
    InstanceView,
    PrefillSkipDecider,
    RouteRequest,
    make_policy,
)


@dataclass(frozen=True)
class GlobalSchedulerConfig:
    routing_policy: str = DEFAULT_POLICY
    # Requests admitted beyond the running seats (max_num_seqs of every instance that
    # decodes); past that, new requests are refused with Retry-After.
    max_queued_requests: int = 256
    # An instance silent this long (no step output, no heartbeat) is taken for dead.
    instance_timeout_s: float = 10.0
    # An instance that heartbeats (its I/O thread lives) but whose step loop has not
    # completed a turn this long is taken for hung (0: never). An idle loop turns every
    # `idle_wait_s`, a busy one every step, so only a single step this long — or a hang —
    # trips it: it must exceed the longest step the deployment can take.
    instance_stall_timeout_s: float = 120.0
    retry_after_s: int = 1
    max_attempts: int = 3  # dispatches of one request, retries included
    skip_prefill_max_tokens: int = 0
    skip_prefill_min_cached_ratio: float = 0.0

    def __post_init__(self) -> None:
        make_policy(self.routing_policy)  # fails early on a bad name
        PrefillSkipDecider(self.skip_prefill_max_tokens, self.skip_prefill_min_cached_ratio)
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.instance_timeout_s <= 0:
            raise ValueError(f"instance_timeout_s must be positive, got {self.instance_timeout_s}")
        if self.instance_stall_timeout_s < 0:
            raise ValueError(
                f"instance_stall_timeout_s must be >= 0, got {self.instance_stall_timeout_s}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")


class AdmissionRejected(Exception):
    """The request cannot be taken now; answer 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Route:
    """Where a request runs. Without a prefill instance, `decode` runs it whole."""

    prefill: InstanceView | None
    decode: InstanceView

    @property
    def first(self) -> InstanceView:
        """The instance that receives the request and computes its prompt."""
        return self.prefill or self.decode

    @property
    def instances(self) -> list[InstanceView]:
        return [self.prefill, self.decode] if self.prefill else [self.decode]


@dataclass
class Assignment:
    request: RouteRequest
    route: Route
    attempts: int = 1
    started: bool = False  # a token reached the gateway: its prompt is computed


@dataclass
class Failover:
    """What to do after an instance died: send `retry` again (resumed where its stream
    stopped), fail `fail`; `abort` maps
    (surviving instance, the request's prefill instance or "") to the requests that
    instance must drop either way — a decode instance also voids late handoffs of them
    from that prefill instance."""

    retry: list[str] = field(default_factory=list)
    fail: list[str] = field(default_factory=list)
    exhausted: list[str] = field(default_factory=list)  # of `fail`: out of retries
    already_dead: bool = False  # nothing was done: the instance was taken out before
    abort: dict[tuple[str, str], list[str]] = field(default_factory=dict)


class GlobalScheduler:
    def __init__(self, config: GlobalSchedulerConfig | None = None) -> None:
        self.config = config or GlobalSchedulerConfig()
        self.policy = make_policy(self.config.routing_policy)
        self.skip_decider = PrefillSkipDecider(
            self.config.skip_prefill_max_tokens, self.config.skip_prefill_min_cached_ratio
        )
        self.views: dict[str, InstanceView] = {}
        self.assignments: dict[str, Assignment] = {}

    # ---- instances -------------------------------------------------------------------

    def add_instance(self, info: InstanceInfo, now: float) -> InstanceView:
        """A new instance, or a dead one's replacement (a restarted process under the
        same id), which must start in an epoch its predecessor never spoke in."""
        instance_id = info.address.instance_id
        previous = self.views.get(instance_id)
        if previous is not None and previous.alive:
            raise ValueError(f"instance {instance_id} is already registered")
        if previous is not None and info.epoch < previous.epoch:
            raise ValueError(
                f"instance {instance_id} starts in epoch {info.epoch}, "
                f"already retired ({previous.epoch})"
            )
        view = InstanceView(info=info, last_seen=now, turned_at=now, epoch=info.epoch)
        self.views[instance_id] = view
        return view

    def live(self, roles: Iterable[str]) -> list[InstanceView]:
        """Instances that take new requests: alive and not draining."""
        wanted = set(roles)
        return [v for v in self.views.values() if v.alive and not v.draining and v.role in wanted]

    def drain(self, instance_id: str) -> InstanceView:
        """Routing sends the instance nothing new from now on (KeyError: unknown or dead)."""
        view = self.views.get(instance_id)
        if view is None or not view.alive:
            raise KeyError(instance_id)
        view.draining = True
        return view

    def switch_role(self, info: InstanceInfo, now: float) -> str | None:
        """A live instance serves in another role from `info.epoch` on (the one after
        its current epoch): it joins that pool, routable again, its prefix-cache mirror
        kept. Returns its former role (None: unknown, dead, or not the next epoch)."""
        view = self.views.get(info.address.instance_id)
        if view is None or not view.alive or info.epoch != view.epoch + 1:
            return None
        old = view.role
        view.info, view.epoch, view.draining = info, info.epoch, False
        view.last_seen = view.turned_at = now
        view.loop_turns = 0
        return old

    def forget(self, instance_id: str) -> None:
        """A drained instance was stopped: it leaves the books (and /health)."""
        self.views.pop(instance_id, None)

    def observe(
        self,
        instance_id: str,
        stats: InstanceStats | None,
        now: float,
        epoch: int = 0,
        loop_turns: int | None = None,
    ) -> bool:
        """An output or heartbeat came from the instance. False if it is unknown or dead,
        or the output is from a retired epoch. `loop_turns`: its step loop's count."""
        view = self.views.get(instance_id)
        if view is None or not view.alive or epoch != view.epoch:
            return False
        view.last_seen = now
        if loop_turns is not None and loop_turns != view.loop_turns:
            view.loop_turns, view.turned_at = loop_turns, now
        if stats is not None:
            view.stats = stats
            view.pending_blocks = 0
        return True

    def apply_block_events(self, instance_id: str, batch: BlockEventBatch) -> bool:
        """Updates the instance's cache mirror; False asks for a snapshot (a gap).

        Batches that arrive out of sync are kept (a bounded few) and replayed on top of
        the snapshot, so events racing the snapshot do not open a new gap."""
        view = self.views.get(instance_id)
        if view is None:
            return True
        if view.mirror.apply(batch):
            return True
        if len(view.unsynced_batches) < MAX_UNSYNCED_BATCHES:
            view.unsynced_batches.append(batch)
        return False

    def apply_snapshot(self, instance_id: str, snapshot: BlockCacheSnapshot) -> bool:
        """Resets the mirror; False if it is still out of sync (request another)."""
        view = self.views.get(instance_id)
        if view is None:
            return True
        view.mirror.reset(snapshot)
        pending = sorted(view.unsynced_batches, key=lambda b: b.seq)
        view.unsynced_batches.clear()
        return all([view.mirror.apply(batch) for batch in pending])

    def find_silent(self, now: float) -> list[str]:
        """Live instances not heard from within the timeout."""
        limit = self.config.instance_timeout_s
        return [i for i, v in self.views.items() if v.alive and now - v.last_seen > limit]

    def find_stalled(self, now: float) -> list[str]:
        """Live instances that heartbeat while their step loop has not turned within the
        stall timeout (a hung step: its I/O thread speaks for a loop that does not)."""
        limit = self.config.instance_stall_timeout_s
        if not limit:
            return []
        return [i for i, v in self.views.items() if v.alive and now - v.turned_at > limit]

    # ---- admission and routing -------------------------------------------------------

    def admit(self, count: int = 1) -> None:
        """Raises AdmissionRejected unless `count` more requests fit."""
        deciders = self.live(ROLES_THAT_DECODE)
        if not deciders:
            raise AdmissionRejected("no instance is available", self.config.retry_after_s)
        seats = sum(v.info.max_num_seqs for v in deciders)
        limit = seats + self.config.max_queued_requests
        if len(self.assignments) + count > limit:
            raise AdmissionRejected(
                f"the server is at capacity ({len(self.assignments)} requests in flight, "
                f"limit {limit}); retry later",
                self.config.retry_after_s,
            )

    def route(
        self, request: RouteRequest, with_prefill: bool = True, avoid: frozenset[str] = frozenset()
    ) -> Route:
        """Picks live instances for the request (raises AdmissionRejected if none).
        Without `with_prefill` it runs whole on one instance (a migrated request: its
        output so far is recomputed there, and a handoff carries only a first token).
        `avoid`: instances a step with it failed on, used only when no other decodes
        (no other prefill instance: it runs whole on its decode instance)."""
        decoders = self.live(ROLES_THAT_DECODE)
        decoders = [v for v in decoders if v.instance_id not in avoid] or decoders
        prefillers = [v for v in self.live(("prefill",)) if v.instance_id not in avoid]
        colocated = [v for v in decoders if v.role == "colocated"]
        if colocated:
            return Route(None, self.policy.pick_colocated(colocated, request))
        if not decoders:
            raise AdmissionRejected("no decode instance is available", self.config.retry_after_s)
        decode = self.policy.pick_decode(decoders, request)
        if not with_prefill or not prefillers or self.skip_decider.should_skip(request, decode):
            return Route(None, decode)
        return Route(self.policy.pick_prefill(prefillers, request), decode)

    def assign(self, request: RouteRequest, route: Route) -> Assignment:
        """Records that the request was sent along `route`."""
        previous = self.assignments.get(request.request_id)
        attempts = previous.attempts + 1 if previous else 1
        if previous:
            self._unassign(previous)
        assignment = Assignment(request, route, attempts)
        self.assignments[request.request_id] = assignment
        first = route.first
        first.unstarted_tokens[request.request_id] = request.num_prompt_tokens
        for view in route.instances:
            view.in_flight.add(request.request_id)
            view.pending_blocks += request.num_blocks(view.block_size)
        return assignment

    def mark_started(self, request_id: str) -> None:
        """The request's first token reached the gateway: its prefill is done."""
        assignment = self.assignments.get(request_id)
        if assignment is not None and not assignment.started:
            assignment.started = True
            assignment.route.first.unstarted_tokens.pop(request_id, None)

    def finish(self, request_id: str) -> Assignment | None:
        """The request ended (finished, aborted, failed): forget it."""
        assignment = self.assignments.pop(request_id, None)
        if assignment is not None:
            self._unassign(assignment)
        return assignment

    def _unassign(self, assignment: Assignment) -> None:
        rid = assignment.request.request_id
        for view in assignment.route.instances:
            view.in_flight.discard(rid)
            view.unstarted_tokens.pop(rid, None)

    # ---- failures --------------------------------------------------------------------

    def release_prefill(self, request_id: str) -> None:
        """The request's decode instance produced output: its KV is there (pulled, or
        recomputed), so the prefill instance's fate no longer touches it."""
        assignment = self.assignments.get(request_id)
        if assignment is None or assignment.route.prefill is None:
            return
        assignment.route.prefill.in_flight.discard(request_id)
        assignment.route.prefill.unstarted_tokens.pop(request_id, None)

    def mark_dead(self, instance_id: str) -> Failover:
        """Takes the instance out of routing and says what becomes of the requests that
        still need it (`in_flight`).

        Each is sent again (up to `max_attempts` dispatches, retries and migrations
        alike: the gateway resumes a stream that has begun), then fails. Its epoch is
        retired: nothing it sends from now on counts.
        """
        failover = Failover()
        view = self.views.get(instance_id)
        if view is None or not view.alive:
            failover.already_dead = True
            return failover
        view.alive = False
        view.epoch += 1
        # Its last load is no longer true: nothing routes on it, nothing reports it.
        total = view.info.num_blocks
        view.stats = InstanceStats(num_free_blocks=total, num_total_blocks=total)
        view.pending_blocks = 0
        for rid in sorted(view.in_flight):
            assignment = self.assignments[rid]
            for other in assignment.route.instances:
                if other is not view and other.alive:
                    key = (other.instance_id, handoffs_from(assignment.route, other))
                    failover.abort.setdefault(key, []).append(rid)
            if assignment.attempts < self.config.max_attempts:
                failover.retry.append(rid)
            else:
                failover.fail.append(rid)
                failover.exhausted.append(rid)
        for rid in failover.fail:
            self.finish(rid)
        for rid in failover.retry:
            self._unassign(self.assignments[rid])
        view.in_flight.clear()
        view.unstarted_tokens.clear()
        return failover


def handoffs_from(route: Route, target: InstanceView) -> str:
    """The prefill instance whose handoffs of a request `target` must void on abort."""
    if route.prefill is not None and target is route.decode:
        return route.prefill.instance_id
    return ""
