"""A launcher without processes, for the decisions of the supervisor and the pools."""

from __future__ import annotations

from pdserve.cluster.launcher import Launcher


class ProcesslessLauncher(Launcher):
    """Launches and watches nothing; a test's subclass says what a start does."""

    def launch(self, specs, on_ready) -> None: ...

    def watch(self, on_exit) -> None: ...

    def shutdown(self) -> None:
        self.stopping.set()
