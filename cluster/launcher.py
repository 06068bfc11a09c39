"""What every launcher does: start instances, report each one ready, watch, shut down.

    launcher.launch(specs, on_ready)     # blocks until all are ready (progress on stderr)
    launcher.watch(on_exit)              # a thread reports instances that die later
    launcher.start_instance(spec, ready)  # one more, or one that died again (if supported)
    launcher.stop_instance(instance_id)  # one drained instance
    launcher.kill_instance(instance_id)  # one fenced (paused or hung) instance, at once
    launcher.shutdown()                  # stops them all and frees their ports

`cancel()` (from a signal handler's thread) makes a `launch` still waiting give up.
"""

from __future__ import annotations

import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TextIO

from pdserve.common.messages import InstanceInfo
from pdserve.instance.spec import InstanceSpec

ReadyCallback = Callable[[InstanceInfo], None]
ExitCallback = Callable[[str, str], object]  # (instance id, reason); its result is unused

PROGRESS_INTERVAL_S = 2.0
# What a stopping instance gets to end its step and exit before it is killed, under
# either launcher.
STOP_GRACE_S = 10.0


class LaunchError(RuntimeError):
    """An instance could not start (or the launch was cancelled); one line."""


class Launcher(ABC):
    can_start = False  # whether start_instance works after the launch

    def __init__(self, ready_timeout_s: float = 600.0) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.cancelled = threading.Event()
        self.stopping = threading.Event()

    @abstractmethod
    def launch(self, specs: list[InstanceSpec], on_ready: ReadyCallback) -> None: ...

    @abstractmethod
    def watch(self, on_exit: ExitCallback) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def resources_of(self, role: str) -> dict[str, float]:
        """The custom resources each instance of the pool asks for (Ray's; none here)."""
        return {}

    def start_instance(self, spec: InstanceSpec, on_ready: ReadyCallback) -> bool:
        """Starts one instance after the launch: one whose process exited, again
        (`cluster/supervisor.py`), or one more for its pool (`cluster/pools.py`).
        `on_ready` once its weights loaded; a later exit goes to `watch`'s callback as
        any other. False: this launcher cannot."""
        return False

    def stop_instance(self, instance_id: str) -> bool:
        """Stops one instance (drained); its exit goes to `watch`'s callback. False:
        this launcher cannot."""
        return False

    def kill_instance(self, instance_id: str) -> bool:
        """Kills one instance at once, whatever it is doing (fenced: paused or hung);
        its exit goes to `watch`'s callback. False: this launcher cannot, or it is gone."""
        return False

    def cancel(self) -> None:
        self.cancelled.set()

    def loading(self, total: int) -> Loading:
        """The wait of a launch for its `total` instances to load, from now."""
        return Loading(self, total)

    def check_loading(self, deadline: float, pending: Iterable[str], cause: str = "") -> None:
        """Gives up a launch that was cancelled, or whose `pending` instances are still
        loading at `deadline` (`cause`: what likely held them, after their names)."""
        if self.cancelled.is_set():
            raise LaunchError("cancelled while instances were loading")
        if time.monotonic() > deadline:
            raise LaunchError(
                f"instances not ready after {self.ready_timeout_s:g} s: {sorted(pending)}{cause}"
            )


class Loading:
    """One launch's wait for its instances' weights: its deadline and progress lines."""

    def __init__(self, launcher: Launcher, total: int) -> None:
        self._launcher = launcher
        self._deadline = time.monotonic() + launcher.ready_timeout_s
        self._progress = LoadProgress(total)

    def check(self, pending: Iterable[str], cause: str = "") -> None:
        """LaunchError when cancelled or past the deadline (`Launcher.check_loading`);
        otherwise a progress line now and then."""
        self._launcher.check_loading(self._deadline, pending, cause)
        self._progress.tick()

    def ready(self, instance_id: str, info: InstanceInfo, on_ready: ReadyCallback) -> None:
        """Hands the loaded instance's `info` on, and says it is ready."""
        on_ready(info)
        self._progress.mark_ready(instance_id, info.kernels)


class LoadProgress:
    """ "loading 2 instances: 1/2 ready (12 s)" every couple of seconds while weights load."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.ready: list[str] = []
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._last = 0.0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def mark_ready(self, instance_id: str, kernels: str = "") -> None:
        self.ready.append(instance_id)
        self._print(f"{instance_id} ready" + (f" (kernels: {kernels})" if kernels else ""))

    def tick(self) -> None:
        if time.monotonic() - self._last >= PROGRESS_INTERVAL_S:
            self._print("loading weights")

    def _print(self, note: str) -> None:
        self._last = time.monotonic()
        print(
            f"pdserve: {len(self.ready)}/{self.total} instances ready "
            f"({self.elapsed:.0f} s): {note}",
            file=self.stream,
            flush=True,
        )
