"""A tensor- and pipeline-parallel worker group: one process per rank behind the
executor seam.

The driver (an instance's step loop, or the offline `LLM`) keeps the step scheduler;
each rank is a child process holding its slice of the weights and of the KV heads
(`engine/parallel.py`), joined to the others by a torch.distributed group (gloo on CPU,
NCCL on GPU). Per step the driver writes the same encoded `StepPlan` to every rank's
pipe; the ranks run the model together (all-reduces inside it), every rank samples the
same tokens from the same gathered logits (so their request mirrors agree), and each
sends back its `StepResult`: the driver takes rank 0's tokens and every rank's KV report.
With pipeline stages (`engine/pipeline.py`) the group holds tp × pp ranks, stage-major;
the stages pass hidden states to each other within the step, and the tokens come from
the last stage's first rank.

A rank that dies takes the group with it: the driver notices at once (its process
sentinel, even between steps), kills every other rank and fails the step; ranks die with
their driver (`PR_SET_PDEATHSIG`, and the pipe's end). No orphan keeps memory or ports.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from pdserve.engine.config import EngineConfig, check_pp_size, check_tp_size
from pdserve.engine.executor import ConnectorFactory
from pdserve.engine.plan import StepPlan, StepResult, WorkerInfo
from pdserve.scheduler.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

_PLAN, _STOP, _OK, _FAILED = b"P", b"S", b"K", b"E"
GROUP_TIMEOUT_S = 120.0  # a collective that waits longer than this has lost a peer


class WorkerGroupFailed(RuntimeError):
    """A rank died or failed: the whole group is gone."""


class WorkerGroupExecutor:
    def __init__(
        self,
        config: EngineConfig,
        connector: ConnectorFactory | None = None,
        on_failure: Callable[[str], None] | None = None,
    ):
        self.config = config
        self.size = config.world_size  # tp ranks per stage, stage after stage
        # The rank whose tokens (and logprobs) the driver takes: the last stage's first.
        self._sampling_rank = self.size - config.tensor_parallel_size
        self.connector = connector  # built in each rank's process
        self._report_type = getattr(connector, "report_type", None)
        # Called once, from the watcher thread, when a rank dies between steps.
        self.on_failure = on_failure
        self._processes: list[mp.process.BaseProcess] = []
        self._pipes: list[Connection] = []
        self._lock = threading.Lock()  # one step at a time on the pipes
        self._closing = threading.Event()
        self._failure: str | None = None
        self._grammars: Any = None
        self.rank_infos: list[WorkerInfo] = []  # what each rank reported when it loaded
        self._decoder = msgspec.msgpack.Decoder(StepResult)
        self._encoder = msgspec.msgpack.Encoder()

    # ---- lifecycle --------------------------------------------------------------------

    def load(self) -> WorkerInfo:
        self._check_split()
        context = mp.get_context("spawn")
        port = _free_port()
        rank_config = self._rank_config()
        for rank in range(self.size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(rank_config, rank, self.size, port, theirs, self.connector),
                name=f"pdserve-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._processes.append(process)
            self._pipes.append(ours)
        try:
            infos = [msgspec.msgpack.decode(reply, type=WorkerInfo) for reply in self._gather(None)]
        except BaseException:
            self.kill()
            raise
        # At interpreter exit multiprocessing ends the ranks itself: not a failure.
        atexit.register(self._closing.set)
        threading.Thread(target=self._watch, name="tp-group-watch", daemon=True).start()
        self.rank_infos = infos
        info = infos[0]
        addresses = [a for i in infos for a in i.connector_addresses]
        return msgspec.structs.replace(info, connector_addresses=addresses) if addresses else info

    def _check_split(self) -> None:
        """A size the model cannot be split by is refused here, before any rank starts."""
        from pdserve.engine.checkpoint import load_model_config
        from pdserve.engine.embedded import embedded_model_path

        mc = load_model_config(self.config.model or embedded_model_path())
        check_tp_size(
            self.config.tensor_parallel_size,
            mc.num_attention_heads,
            mc.num_key_value_heads,
            mc.intermediate_size,
        )
        check_pp_size(self.config.pipeline_parallel_size, mc.num_hidden_layers)

    @property
    def rank_pids(self) -> list[int | None]:
        return [process.pid for process in self._processes]

    def _rank_config(self) -> EngineConfig:
        """Each rank: its share of the cores and of the instance's KV memory."""
        cores = self.config.resolved_threads()
        return dataclasses.replace(
            self.config,
            num_threads=max(1, cores // self.size),
            kv_cache_memory=max(1, self.config.kv_cache_memory // self.size),
        )

    def execute(self, plan: StepPlan) -> StepResult:
        with self._lock:
            self._raise_if_failed()
            message = _PLAN + self._encoder.encode(plan)
            for pipe in self._pipes:
                pipe.send_bytes(message)
            results = [self._decoder.decode(reply) for reply in self._gather(None)]
        reports = [report for result in results for report in result.kv_reports]
        if self._report_type is not None:  # decoded as plain data: back to the connector's type
            reports = [msgspec.convert(r, self._report_type) for r in reports]
        sampler = results[self._sampling_rank]
        return StepResult(
            sampled=sampler.sampled,
            kv_reports=reports,
            collective_seconds=sampler.collective_seconds,
            stage_transfer_seconds=max(r.stage_transfer_seconds for r in results),
        )

    def prepare_grammar(self, spec: StructuredOutput) -> Future[Any]:
        """Compiled here first, off the step loop and within the driver's budget; each
        rank compiles its own copy (fast: the same grammar, warm) when the request
        reaches it."""
        if self._grammars is None:
            from pdserve.engine.grammar import GrammarBook
            from pdserve.engine.worker import model_tokenizer_facts

            folder, vocab, stops = model_tokenizer_facts(self.config)
            self._grammars = GrammarBook(folder, vocab, stops)
        return self._grammars.prepare(spec)

    def shutdown(self) -> None:
        self._closing.set()
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send_bytes(_STOP)
        for process in self._processes:
            process.join(timeout=10)
        self.kill()
        if self._grammars is not None:
            self._grammars.shutdown()

    def kill(self) -> None:
        """Every rank ends now (SIGKILL: a rank blocked in a collective hears nothing else)."""
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(timeout=10)

    # ---- talking to the ranks -----------------------------------------------------------

    def _gather(self, timeout_s: float | None) -> list[bytes]:
        """One reply from every rank, in rank order; a rank that dies or fails ends the
        group (WorkerGroupFailed)."""
        replies: dict[int, bytes] = {}
        sentinels = {p.sentinel: i for i, p in enumerate(self._processes)}
        pipes = {id(pipe): i for i, pipe in enumerate(self._pipes)}
        while len(replies) < self.size:
            waiting = [p for i, p in enumerate(self._pipes) if i not in replies]
            ready = wait([*waiting, *sentinels], timeout=timeout_s)
            if not ready:
                self._fail("no reply from the group in time")
            for item in ready:
                if isinstance(item, int):  # a process sentinel: that rank is gone
                    rank = sentinels[item]
                    self._processes[rank].join(timeout=1)  # reaped: its exit code is known
                    code = self._processes[rank].exitcode
                    self._fail(f"rank {rank} of the worker group died (exit code {code})")
                rank = pipes[id(item)]
                try:
                    data = item.recv_bytes()
                except (EOFError, OSError):
                    self._fail(f"rank {rank} of the worker group died")
                if data[:1] == _FAILED:
                    reason = f"rank {rank}: {data[1:].decode(errors='replace')}"
                    self._fail(self._killed_rank() or reason)
                replies[rank] = data[1:]
        return [replies[i] for i in range(self.size)]

    def _killed_rank(self, within_s: float = 1.0) -> str | None:
        """A rank's failed collective is mostly a peer that died (a pipeline stage hears
        of it before the driver sees the process end): name that one if there is one."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._processes)}
        for sentinel in wait(list(sentinels), timeout=within_s):
            rank = sentinels[sentinel]
            self._processes[rank].join(timeout=1)
            code = self._processes[rank].exitcode
            if code not in (0, None):  # a rank that reported its failure exits with 0
                return f"rank {rank} of the worker group died (exit code {code})"
        return None

    def _fail(self, reason: str) -> None:
        self._failure = self._failure or reason
        self.kill()
        raise WorkerGroupFailed(self._failure)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WorkerGroupFailed(self._failure)

    def _watch(self) -> None:
        """Between steps too: the first rank to die takes the group down at once."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._processes)}
        ready = wait(list(sentinels))
        if self._closing.is_set():
            return
        dead = sentinels[ready[0]]  # not is_alive(): the stepping thread may reap it first
        self._processes[dead].join(timeout=1)
        reason = (
            f"rank {dead} of the worker group died (exit code {self._processes[dead].exitcode})"
        )
        logger.error("%s: stopping the group", reason)
        self._failure = self._failure or reason
        self.kill()
        if self.on_failure is not None:
            self.on_failure(reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the driver dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the driver died before we got here
        os._exit(1)


def _rank_main(
    config: EngineConfig,
    rank: int,
    size: int,
    port: int,
    pipe: Connection,
    connector_factory: ConnectorFactory | None,
) -> None:
    _die_with_parent()
    import torch.distributed as dist

    from pdserve.engine.pipeline import join_group
    from pdserve.engine.worker import ModelWorker

    config, tp, stage = join_group(config, rank, port, GROUP_TIMEOUT_S)
    connector = connector_factory(tp.rank, tp.size) if connector_factory is not None else None
    metadata_type = getattr(connector_factory, "metadata_type", None)
    worker = ModelWorker(config, connector, tp, stage)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepPlan)
    try:
        pipe.send_bytes(_OK + encoder.encode(worker.load()))
        while True:
            try:
                message = pipe.recv_bytes()
            except EOFError:
                break  # the driver is gone
            if message[:1] == _STOP:
                break
            plan = decoder.decode(message[1:])
            if plan.kv_connector is not None and metadata_type is not None:
                plan.kv_connector = msgspec.convert(plan.kv_connector, metadata_type)
            result = worker.execute(plan)
            pipe.send_bytes(_OK + encoder.encode(result))
    except Exception as exc:  # reported to the driver, which ends the group
        logger.exception("rank %d failed", rank)
        with contextlib.suppress(OSError):
            pipe.send_bytes(_FAILED + f"{type(exc).__name__}: {exc}".encode())
    finally:
        worker.shutdown()
        dist.destroy_process_group()
