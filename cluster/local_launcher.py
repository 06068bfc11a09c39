"""The Ray-free launcher: each instance a plain child process on this machine.

The same topology as the Ray launcher, for one machine, tests, and hosts without Ray.
A child prints one READY (or FAILED) line on stdout when its weights are loaded; it
gets SIGTERM when this process dies (PDSERVE_PARENT_PID), so none outlives it. An
instance can be started after the launch (`start_instance`: again, or one more), its
READY line then coming to the watch thread, and stopped alone (`stop_instance`).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import msgspec

from pdserve.cluster.launcher import (
    STOP_GRACE_S,
    ExitCallback,
    Launcher,
    LaunchError,
    ReadyCallback,
)
from pdserve.common.messages import InstanceInfo
from pdserve.common.wire_auth import SECRET_ENV, SECRET_FILE_ENV, ensure_secret
from pdserve.instance.main import FAILED_PREFIX, READY_PREFIX
from pdserve.instance.spec import InstanceSpec


class LocalLauncher(Launcher):
    can_start = True

    def __init__(self, ready_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        super().__init__(ready_timeout_s)
        self.env = env
        self.processes: dict[str, subprocess.Popen] = {}
        self._events: queue.Queue[tuple[str, str, str]] = queue.Queue()
        self._readers: list[threading.Thread] = []
        self._watcher: threading.Thread | None = None
        self._starting: dict[str, ReadyCallback] = {}  # started after the launch, loading
        self._lock = threading.Lock()  # starts (other threads) against shutdown

    # ---- launching --------------------------------------------------------------------

    def launch(self, specs: list[InstanceSpec], on_ready: ReadyCallback) -> None:
        for spec in specs:
            self._spawn(spec)
        loading = self.loading(len(specs))
        pending = {spec.instance_id for spec in specs}
        while pending:
            loading.check(pending)
            try:
                instance_id, kind, payload = self._events.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "ready":
                info = msgspec.json.decode(payload, type=InstanceInfo)
                loading.ready(instance_id, info, on_ready)
                pending.discard(instance_id)
            elif kind == "failed":
                raise LaunchError(f"{instance_id} failed to start: {payload}")
            elif kind == "eof":
                code = self.processes[instance_id].wait()
                raise LaunchError(f"{instance_id} exited with code {code} while loading")

    def child_env(self, spec: InstanceSpec) -> dict[str, str]:
        env = dict(self.env if self.env is not None else os.environ)
        env["PDSERVE_PARENT_PID"] = str(os.getpid())
        if SECRET_ENV not in env and SECRET_FILE_ENV not in env:
            env[SECRET_ENV] = ensure_secret()  # the gateway's: in the environment, not argv
        if spec.gpus:  # rank r of the instance uses the r-th: cuda:r
            env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
        return env

    def start_instance(self, spec: InstanceSpec, on_ready: ReadyCallback) -> bool:
        with self._lock:
            if self.stopping.is_set():
                return False
            self._starting[spec.instance_id] = on_ready
            self._spawn(spec)
        return True

    def stop_instance(self, instance_id: str) -> bool:
        """SIGTERM (the step loop ends after its step), SIGKILL after the grace period."""
        process = self.processes.get(instance_id)
        if process is None or process.poll() is not None:
            return False
        process.send_signal(signal.SIGTERM)
        timer = threading.Timer(
            STOP_GRACE_S, lambda: process.kill() if process.poll() is None else None
        )
        timer.daemon = True
        timer.start()
        return True

    def kill_instance(self, instance_id: str) -> bool:
        """SIGKILL: a stopped (SIGSTOP) or hung process dies too."""
        process = self.processes.get(instance_id)
        if process is None or process.poll() is not None:
            return False
        process.kill()
        return True

    def _spawn(self, spec: InstanceSpec) -> None:
        env = self.child_env(spec)
        command = [
            sys.executable,
            "-m",
            "pdserve.instance.main",
            spec.instance_id,
            "--spec",
            msgspec.json.encode(spec).decode(),
        ]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True
        )
        self.processes[spec.instance_id] = process
        reader = threading.Thread(target=self._read, args=(spec.instance_id, process), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _read(self, instance_id: str, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(READY_PREFIX):
                self._events.put((instance_id, "ready", line[len(READY_PREFIX) :]))
            elif line.startswith(FAILED_PREFIX):
                self._events.put((instance_id, "failed", line[len(FAILED_PREFIX) :].strip()))
            else:
                sys.stderr.write(f"[{instance_id}] {line}")
        self._events.put((instance_id, "eof", ""))

    # ---- watching ---------------------------------------------------------------------

    def watch(self, on_exit: ExitCallback) -> None:
        last_words: dict[str, str] = {}  # why an instance is about to exit, in its words

        def run() -> None:
            while not self.stopping.is_set():
                try:
                    instance_id, kind, payload = self._events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if kind == "ready" and instance_id in self._starting:
                    on_ready = self._starting.pop(instance_id)
                    on_ready(msgspec.json.decode(payload, type=InstanceInfo))
                elif kind == "failed":
                    last_words[instance_id] = payload
                elif kind == "eof" and not self.stopping.is_set():
                    self._starting.pop(instance_id, None)  # died while loading
                    code = self.processes[instance_id].wait()
                    why = last_words.pop(instance_id, None)
                    on_exit(instance_id, why or f"its process exited with code {code}")

        self._watcher = threading.Thread(target=run, name="local-launcher-watch", daemon=True)
        self._watcher.start()

    # ---- stopping ---------------------------------------------------------------------

    def shutdown(self) -> None:
        """SIGTERM to every child, SIGKILL to any still alive after the grace period."""
        with self._lock:  # no process starts after this
            self.stopping.set()
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for reader in self._readers:
            reader.join(timeout=2.0)
        if self._watcher is not None:
            self._watcher.join(timeout=2.0)

    def pids(self) -> dict[str, int]:
        return {instance_id: p.pid for instance_id, p in self.processes.items()}
