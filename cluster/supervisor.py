"""Restarts instances whose process exited or that were fenced, so a pool goes back to
its planned size.

The launcher's watch reports an exit; the gateway takes the instance out (its epoch
retired, its requests migrated or retried); then `instance_exited` has the launcher start
it again under the same id from its spec, in the epoch the gateway retired it into, and
the gateway re-admits it once its weights have loaded (`Dispatcher.register`). One that
keeps dying soon after a restart waits longer each time (1 s, 2 s, ... up to a minute),
so a crash loop does not spin. An instance taken for dead while its process may live
on (silent: paused; or a stalled loop: hung) is fenced by the gateway, killed here
(`fence`: SIGKILL, or `ray.kill`), and its exit restarts it as any other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pdserve.cluster.launcher import Launcher, ReadyCallback
from pdserve.instance.spec import InstanceSpec

logger = logging.getLogger(__name__)

# A restart this long after the previous one counts as the first again.
STABLE_S = 60.0
MAX_DELAY_S = 60.0


@dataclass
class _History:
    quick_restarts: int = 0  # restarts each within STABLE_S of the one before
    last_at: float = float("-inf")


class Supervisor:
    def __init__(
        self,
        launcher: Launcher,
        specs: list[InstanceSpec],
        on_ready: ReadyCallback,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_ready`: told each restarted instance's info once its weights loaded (from
        the launcher's thread, as at launch)."""
        self.launcher = launcher
        self.specs = {spec.instance_id: spec for spec in specs}
        self.on_ready = on_ready
        self.clock = clock
        self._history: dict[str, _History] = {}
        self._timers: list[threading.Timer] = []

    def delay_s(self, instance_id: str) -> float:
        """How long to wait before this restart (0 unless it died soon after the last)."""
        history = self._history.setdefault(instance_id, _History())
        now = self.clock()
        if now - history.last_at > STABLE_S:
            history.quick_restarts = 0
        delay = 0.0 if not history.quick_restarts else 2.0 ** (history.quick_restarts - 1)
        delay = min(MAX_DELAY_S, delay)
        history.quick_restarts += 1
        history.last_at = now + delay
        return delay

    def instance_exited(self, instance_id: str, epoch: int) -> None:
        """The instance's process exited and the gateway retired it: start it again in
        `epoch` (after a delay if it keeps dying). Any thread."""
        spec = self.specs.get(instance_id)
        if spec is None or self.launcher.stopping.is_set():
            return
        restart = msgspec.structs.replace(spec, epoch=epoch)
        delay = self.delay_s(instance_id)
        timer = threading.Timer(delay, self._restart, (restart,))
        timer.daemon = True
        self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()
        logger.warning("%s: restarting in %g s (epoch %d)", instance_id, delay, epoch)

    def fence(self, instance_id: str) -> None:
        """The gateway fenced the instance (its epoch retired): kill it; its exit then
        restarts it. Called on the gateway's loop, where exits are handled too, so the
        kill never reaches a replacement (a kill is a signal, or one quick call to Ray)."""
        if self.launcher.stopping.is_set():
            return
        if self.launcher.kill_instance(instance_id):
            logger.warning("%s: fenced, killed; its replacement starts next", instance_id)
        else:
            logger.warning("%s: fenced, but there was no process to kill", instance_id)

    def _restart(self, spec: InstanceSpec) -> None:
        if self.launcher.stopping.is_set():
            return
        if spec.instance_id not in self.specs:
            return  # retired (drained) meanwhile
        if not self.launcher.start_instance(spec, self.on_ready):
            logger.warning(
                "%s is not restarted: this launcher cannot start instances; its pool "
                "stays one short",
                spec.instance_id,
            )

    def knows(self, instance_id: str) -> bool:
        """Whether the instance belongs to a pool (planned or added, not retired)."""
        return instance_id in self.specs

    def add(self, spec: InstanceSpec) -> None:
        """One more instance to keep up (a pool scaled up)."""
        self.specs[spec.instance_id] = spec

    def retire(self, instance_id: str) -> None:
        """Never restart the instance again (it drains, then stops)."""
        self.specs.pop(instance_id, None)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
