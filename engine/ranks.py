"""How a worker group's ranks are started and talked to: the seam under
`WorkerGroupExecutor`.

A `RankLauncher` starts one rank per `RankJob` (each runs `worker_group.run_rank` with
its rank, the world size and the rendezvous address) and gives back a `RankGroup`: one
channel of small encoded messages per rank, and a way to know at once that a rank died.
`ProcessRanks` (the default: `pdserve.LLM`, `--launcher local`) spawns child processes
with a pipe each; `cluster/ray_ranks.py` runs each rank as a Ray actor in the instance's
placement group (Ray only inside cluster/, so it plugs in here without engine/ knowing).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import NoReturn, Protocol, cast

from pdserve.engine.config import EngineConfig
from pdserve.engine.devices import group_devices
from pdserve.engine.executor import ConnectorFactory


class WorkerGroupFailed(RuntimeError):
    """A rank died or failed: the whole group is gone."""


@dataclass(frozen=True)
class RankJob:
    """What one rank runs (picklable: it crosses into the rank's process)."""

    config: EngineConfig  # the rank's own: its threads, KV share and device
    rank: int
    size: int
    master: str  # host:port of the torch.distributed rendezvous (rank 0 binds it)
    connector: ConnectorFactory | None = None


class RankChannel(Protocol):
    """A rank's end of its channel to the driver."""

    def send_bytes(self, data: bytes) -> None: ...

    def recv_bytes(self) -> bytes:
        """The driver's next message; EOFError once the driver is gone."""
        ...


class RankGroup(Protocol):
    """The driver's view of started ranks."""

    def send(self, rank: int, data: bytes) -> None: ...

    def receive(self, waiting: set[int]) -> list[tuple[int, bytes]]:
        """Blocks until at least one rank in `waiting` replied; raises WorkerGroupFailed
        when a rank died (before or while waiting)."""
        ...

    def wait_for_death(self) -> tuple[int, str] | None:
        """Blocks until a rank dies: (rank, why); None once the group was closed."""
        ...

    def pids(self) -> list[int | None]: ...

    def close(self, timeout_s: float) -> None:
        """After a stop message: waits up to `timeout_s` for the ranks to end, then
        kills what is left."""
        ...

    def kill(self) -> None:
        """Every rank ends now (a rank blocked in a collective hears nothing else)."""
        ...


class RankLauncher(Protocol):
    def master_host(self) -> str:
        """Where rank 0 binds the rendezvous (an address every rank can reach)."""
        ...

    def devices(self, size: int, device: str) -> list[str]:
        """The device each of `size` ranks names for the group's `device` ("cpu", "cuda",
        "cuda:N"): one GPU per rank, as the rank's process sees it (`engine/devices.py`);
        DeviceError when the ranks cannot each have one."""
        ...

    def start(self, jobs: list[RankJob]) -> RankGroup: ...


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ProcessRanks:
    """Child processes of the driver (multiprocessing spawn), a pipe each."""

    def master_host(self) -> str:
        return "127.0.0.1"

    def devices(self, size: int, device: str) -> list[str]:
        return group_devices(device, size)  # the children see what this process sees

    def start(self, jobs: list[RankJob]) -> ProcessGroup:
        context = mp.get_context("spawn")
        processes: list[mp.process.BaseProcess] = []
        pipes: list[Connection] = []
        for job in jobs:
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_process_main,
                args=(job, theirs),
                name=f"pdserve-tp-rank-{job.rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            processes.append(process)
            pipes.append(ours)
        return ProcessGroup(processes, pipes)


class ProcessGroup:
    def __init__(self, processes: list[mp.process.BaseProcess], pipes: list[Connection]) -> None:
        self.processes = processes
        self.pipes = pipes
        self._closed = False

    def send(self, rank: int, data: bytes) -> None:
        try:
            self.pipes[rank].send_bytes(data)
        except OSError:
            self._died(rank)

    def receive(self, waiting: set[int]) -> list[tuple[int, bytes]]:
        sentinels = {p.sentinel: i for i, p in enumerate(self.processes)}
        ready = wait([*(self.pipes[i] for i in waiting), *sentinels])
        replies = []
        for item in ready:
            if isinstance(item, int):  # a process sentinel: that rank is gone
                self._died(sentinels[item])
            pipe = cast(Connection, item)  # not a sentinel: one of the pipes
            rank = self.pipes.index(pipe)
            try:
                replies.append((rank, pipe.recv_bytes()))
            except (EOFError, OSError):
                self._died(rank)
        return replies

    def _died(self, rank: int) -> NoReturn:
        raise WorkerGroupFailed(f"rank {rank} of the worker group died ({self._exit(rank)})")

    def _exit(self, rank: int) -> str:
        self.processes[rank].join(timeout=1)  # reaped: its exit code is known
        return f"exit code {self.processes[rank].exitcode}"

    def wait_for_death(self) -> tuple[int, str] | None:
        sentinels = {p.sentinel: i for i, p in enumerate(self.processes)}
        ready = wait(list(sentinels))
        if self._closed:
            return None
        # not is_alive(): the stepping thread may reap it first
        dead = sentinels[cast(int, ready[0])]
        return dead, self._exit(dead)

    def pids(self) -> list[int | None]:
        return [process.pid for process in self.processes]

    def close(self, timeout_s: float) -> None:
        self._closed = True
        for process in self.processes:
            process.join(timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=10)


class PipeChannel:
    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe

    def send_bytes(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the driver is gone: the next recv says so
            self.pipe.send_bytes(data)

    def recv_bytes(self) -> bytes:
        return self.pipe.recv_bytes()


def _process_main(job: RankJob, pipe: Connection) -> None:
    _die_with_parent()
    from pdserve.engine.worker_group import run_rank

    run_rank(job, PipeChannel(pipe))


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the driver dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the driver died before we got here
        os._exit(1)
