"""The Ray launcher's actors after the launch: the death watch, and single actors started
(a restart, or one more for a pool), stopped (drained) or killed (fenced).

One thread waits on two kinds of calls: each loading actor's `load()` (its result is
the instance's READY: `on_ready`, then its `run()` is watched) and each running actor's
`run()` (it returns only when the step loop ends or the actor dies: SIGKILL,
`ray.kill`, its node lost, which Ray may first report as `ActorUnavailableError`). An
actor whose call ended is killed for good (its resources, placement group and name are
freed) and its exit reported (`on_exit`); the supervisor then starts it again.

Starting an actor never blocks the caller: the actor is queued for creation on one of
`CREATE_WORKERS` threads (a tensor-parallel one waits for its placement group there),
never a thread per actor, and its `load()` is watched like any other. An actor Ray
cannot place (its node lost, no other node with room: "pools full" means the
configured sizes on the nodes that remain) stays pending until room appears; it is
logged once, and neither the watch nor the supervisor waits on it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from pdserve.cluster.launcher import STOP_GRACE_S, ExitCallback, ReadyCallback
from pdserve.cluster.ray_actors import InstanceHandle
from pdserve.cluster.ray_cluster import one_line
from pdserve.common.messages import InstanceInfo
from pdserve.instance.spec import InstanceSpec

if TYPE_CHECKING:
    from pdserve.cluster.ray_launcher import RayLauncher

logger = logging.getLogger(__name__)

WAIT_S = 0.5
# A restarted actor's name may stay taken a moment after its predecessor was killed.
NAME_WAIT_S = 30.0
# An actor still loading this long is said (once) to wait for room in the cluster.
PLACEMENT_NOTE_S = 30.0
# Actors created at once after the launch (restarts and pools scaled up alike).
CREATE_WORKERS = 4


@dataclass
class _Call:
    """One watched call of one actor: its `load()` (`on_ready` set) or its `run()`."""

    instance_id: str
    actor: InstanceHandle
    on_ready: ReadyCallback | None
    since: float
    noted: bool = False


class ActorWatch:
    def __init__(self, launcher: RayLauncher) -> None:
        self.launcher = launcher
        self._calls: dict[object, _Call] = {}
        self._lock = threading.Lock()
        self._on_exit: ExitCallback | None = None
        self._thread: threading.Thread | None = None
        self._stopped: set[str] = set()  # drained for good (an id is never reused)
        self._creator = ThreadPoolExecutor(CREATE_WORKERS, thread_name_prefix="ray-start")

    # ---- watching ---------------------------------------------------------------------

    def start(self, on_exit: ExitCallback) -> None:
        """Watches the launched actors' `run()` calls, and every actor started later."""
        self._on_exit = on_exit
        now = time.monotonic()
        with self._lock:
            for ref, instance_id in self.launcher.run_refs.items():
                actor = self.launcher.actors[instance_id]
                self._calls[ref] = _Call(instance_id, actor, None, now)
        self._thread = threading.Thread(target=self._run, name="ray-launcher-watch", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._creator.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        ray = self.launcher._ray()
        while not self.launcher.stopping.is_set():
            with self._lock:
                refs = list(self._calls)
            if not refs:
                time.sleep(WAIT_S)
                continue
            done, _ = ray.wait(refs, num_returns=1, timeout=WAIT_S)
            for ref in done:
                with self._lock:
                    call = self._calls.pop(ref, None)
                if call is not None and not self.launcher.stopping.is_set():
                    self._ended(ref, call)
            self._note_unplaced()

    def _ended(self, ref: object, call: _Call) -> None:
        ray = self.launcher._ray()
        self.launcher.run_refs.pop(ref, None)
        if self.launcher.actors.get(call.instance_id) is not call.actor:
            return  # a former life's call, its end already handled
        try:
            result = ray.get(ref)
        except Exception as exc:  # RayActorError (died, unavailable), or a failed load
            if call.on_ready is None:
                self._gone(call, f"the actor died: {one_line(exc)}")
                return
            # (e.g. placed on a node whose loss Ray had not noticed yet)
            logger.warning("%s: its actor failed to load: %s", call.instance_id, one_line(exc))
            self._gone(call, f"failed to load: {one_line(exc)}")
            return
        if call.on_ready is None:
            self._gone(call, result if isinstance(result, str) else "its step loop ended")
            return
        if call.instance_id in self._stopped:  # drained while it was being started again
            self._gone(call, "stopped while it loaded")
            return
        call.on_ready(msgspec.json.decode(result, type=InstanceInfo))
        run = call.actor.run.remote()
        with self._lock:
            self.launcher.run_refs[run] = call.instance_id
            self._calls[run] = _Call(call.instance_id, call.actor, None, time.monotonic())

    def _gone(self, call: _Call, reason: str) -> None:
        """Kills what is left of the actor (a loop that ended leaves its process, resources
        and name held), frees its placement group, reports the exit."""
        self._kill(call.actor)
        self._remove_group(call.instance_id)
        if self._on_exit is not None:
            self._on_exit(call.instance_id, reason)

    def _note_unplaced(self) -> None:
        now = time.monotonic()
        with self._lock:
            waiting = [c for c in self._calls.values() if c.on_ready is not None]
        for call in waiting:
            if not call.noted and now - call.since > PLACEMENT_NOTE_S:
                call.noted = True
                logger.warning(
                    "%s: not loaded %.0f s after its start; waiting for a node with room "
                    "for it (its CPUs, GPUs and custom resources)",
                    call.instance_id,
                    now - call.since,
                )

    # ---- single actors ----------------------------------------------------------------

    def start_instance(self, spec: InstanceSpec, on_ready: ReadyCallback) -> bool:
        """Queues the instance's actor for creation on the creator's threads (a
        predecessor of the same id is killed first); its READY goes to `on_ready`, a
        failure to `on_exit`."""
        if self.launcher.stopping.is_set():
            return False
        self.launcher.inherit_share(spec)
        self._creator.submit(self._create_or_report, spec, on_ready)
        return True

    def _create_or_report(self, spec: InstanceSpec, on_ready: ReadyCallback) -> None:
        try:
            self._create(spec, on_ready)
        except Exception as exc:  # a pool thread's exception would go unseen
            self._failed(spec.instance_id, f"cannot create its actor: {one_line(exc)}")

    def _create(self, spec: InstanceSpec, on_ready: ReadyCallback) -> None:
        instance_id = spec.instance_id
        previous = self.launcher.actors.get(instance_id)
        if previous is not None:
            self._kill(previous)
        self._remove_group(instance_id)
        actor = self._create_named(spec)
        if actor is None:
            return
        with self._lock:
            self.launcher.actors[instance_id] = actor
            self._calls[actor.load.remote()] = _Call(instance_id, actor, on_ready, time.monotonic())
        # Shutdown began, or it was drained, meanwhile (maybe past this actor): its load
        # then fails, and its end is reported as any other.
        if self.launcher.stopping.is_set() or instance_id in self._stopped:
            self._kill(actor)

    def _create_named(self, spec: InstanceSpec) -> InstanceHandle | None:
        """The actor, or None (reported) if it cannot be created."""
        deadline = time.monotonic() + NAME_WAIT_S
        while not self.launcher.stopping.is_set():
            try:
                return self.launcher.create_actor(spec)
            except ValueError as exc:  # the name: its predecessor is not dead to Ray yet
                if time.monotonic() > deadline:
                    self._failed(spec.instance_id, f"cannot create its actor: {exc}")
                    return None
                time.sleep(WAIT_S)
            except Exception as exc:  # LaunchError (no room for its ranks), Ray's own
                self._failed(spec.instance_id, f"cannot create its actor: {one_line(exc)}")
                return None
        return None

    def _failed(self, instance_id: str, reason: str) -> None:
        logger.warning("%s: %s", instance_id, reason)
        if self._on_exit is not None and not self.launcher.stopping.is_set():
            self._on_exit(instance_id, reason)

    def stop_instance(self, instance_id: str) -> bool:
        """Asks its step loop to end (drained: nothing left to finish), killed after a
        grace period; one still loading is killed at once."""
        self._stopped.add(instance_id)
        actor = self.launcher.actors.get(instance_id)
        if actor is None:
            return False
        with self._lock:
            loading = any(c.actor is actor and c.on_ready is not None for c in self._calls.values())
        if loading:
            self._kill(actor)
            return True
        with contextlib.suppress(Exception):
            actor.stop.remote()
        timer = threading.Timer(STOP_GRACE_S, self._kill, (actor,))
        timer.daemon = True
        timer.start()
        return True

    def kill_instance(self, instance_id: str) -> bool:
        """`ray.kill`: its process dies whatever it does (a paused one too)."""
        actor = self.launcher.actors.get(instance_id)
        if actor is None:
            return False
        self._kill(actor)
        return True

    def _kill(self, actor: object) -> None:
        with contextlib.suppress(Exception):  # already dead, or its node gone
            self.launcher._ray().kill(actor, no_restart=True)

    def _remove_group(self, instance_id: str) -> None:
        for group in self.launcher.placement_groups.pop(instance_id, []):
            with contextlib.suppress(Exception):
                self.launcher._ray().util.remove_placement_group(group)
