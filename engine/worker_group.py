"""A tensor- and pipeline-parallel worker group: one process per rank behind the
executor seam.

The driver (an instance's step loop, or the offline `LLM`) keeps the step scheduler;
each rank holds its slice of the weights and of the KV heads (`engine/parallel.py`),
joined to the others by a torch.distributed group (gloo on CPU, NCCL on GPU). How ranks
start and what carries their messages is the `RankLauncher`'s (`engine/ranks.py`):
child processes with a pipe each by default, Ray actors under the Ray launcher. Per step
the driver sends the same encoded `StepPlan` to every rank; the ranks run the model
together (all-reduces inside it), every rank samples the same tokens from the same
gathered logits (so their request mirrors agree), and each sends back its `StepResult`:
the driver takes the sampling rank's tokens (and prompt logprobs) and every rank's KV
report, and counts the frames each rank's process dropped (its KV sockets') in its own
book, which the instance ships to the gateway (`common/frame_drops.py`).
With pipeline stages (`engine/pipeline.py`) the group holds tp × pp ranks, stage-major;
the stages pass hidden states to each other within the step, and the tokens come from
the last stage's first rank.

A rank that dies takes the group with it: the driver notices at once (the launcher's
death signal, even between steps), kills every other rank and fails the step; ranks die
with their driver. No orphan keeps memory or ports.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec

from pdserve.common.frame_drops import DROPS
from pdserve.common.messages import DroppedFrames
from pdserve.common.model_split import check_int8_groups, check_pp_size, check_tp_size
from pdserve.common.structured_output import StructuredOutput
from pdserve.common.wire_auth import SecretError
from pdserve.engine.config import EngineConfig
from pdserve.engine.devices import use_device
from pdserve.engine.executor import ConnectorFactory
from pdserve.engine.ranks import (
    ProcessRanks,
    RankChannel,
    RankGroup,
    RankJob,
    RankLauncher,
    WorkerGroupFailed,
)
from pdserve.engine.step_plan import StepPlan, StepResult, WorkerInfo

logger = logging.getLogger(__name__)

__all__ = ["WorkerGroupExecutor", "WorkerGroupFailed", "run_rank"]

_PLAN, _STOP, _OK, _FAILED = b"P", b"S", b"K", b"E"
GROUP_TIMEOUT_S = 120.0  # a collective that waits longer than this has lost a peer
DEATH_GRACE_S = 1.0  # how long a failed step waits to learn whether a rank died


class WorkerGroupExecutor:
    def __init__(
        self,
        config: EngineConfig,
        connector: ConnectorFactory | None = None,
        on_failure: Callable[[str], None] | None = None,
        launcher: RankLauncher | None = None,
    ):
        self.config = config
        self.size = config.world_size  # tp ranks per stage, stage after stage
        # The rank whose tokens (and logprobs) the driver takes: the last stage's first.
        self._sampling_rank = self.size - config.tensor_parallel_size
        self.connector = connector  # built in each rank's process
        self.launcher: RankLauncher = launcher or ProcessRanks()
        self._report_type = getattr(connector, "report_type", None)
        # Called once, from the watcher thread, when a rank dies between steps.
        self.on_failure = on_failure
        self._group: RankGroup | None = None
        self._rendezvous: Any = None  # the group's store (`rendezvous.Rendezvous`), while it lives
        self._lock = threading.Lock()  # one step at a time on the channels
        self._closing = threading.Event()
        self._death_named = threading.Event()  # the watcher saw a rank die
        self._failure: str | None = None
        self._grammars: Any = None
        self.rank_infos: list[WorkerInfo] = []  # what each rank reported when it loaded
        self._decoder = msgspec.msgpack.Decoder(StepResult)
        self._encoder = msgspec.msgpack.Encoder()

    # ---- lifecycle --------------------------------------------------------------------

    def load(self) -> WorkerInfo:
        self._check_split()
        from pdserve.engine.rendezvous import Rendezvous

        self._rendezvous = Rendezvous(self.launcher.master_host(), GROUP_TIMEOUT_S)
        master = self._rendezvous.address
        devices = self.launcher.devices(self.size, self.config.device)
        jobs = [
            RankJob(self._rank_config(device), rank, self.size, master, self.connector)
            for rank, device in enumerate(devices)
        ]
        self._group = self.launcher.start(jobs)
        try:
            infos = [msgspec.msgpack.decode(reply, type=WorkerInfo) for reply in self._gather()]
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
        if self.config.quantization == "int8":
            check_int8_groups(
                self.config.tensor_parallel_size,
                mc.hidden_size,
                mc.num_attention_heads * mc.head_dim,
                mc.intermediate_size,
            )

    @property
    def rank_pids(self) -> list[int | None]:
        return self._group.pids() if self._group is not None else []

    def _rank_config(self, device: str) -> EngineConfig:
        """Each rank: its share of the cores and of the instance's KV memory, and its
        own GPU as its process sees it (the launcher's to say)."""
        cores = self.config.resolved_threads()
        return msgspec.structs.replace(
            self.config,
            num_threads=max(1, cores // self.size),
            kv_cache_memory=max(1, self.config.kv_cache_memory // self.size),
            device=device,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        with self._lock:
            self._raise_if_failed()
            message = _PLAN + self._encoder.encode(plan)
            for rank in range(self.size):
                self._send(rank, message)
            results = [self._decoder.decode(reply) for reply in self._gather()]
        for result in results:
            for dropped in result.dropped_frames:
                DROPS.count(dropped.channel, dropped.reason, dropped.count)
        reports = [report for result in results for report in result.kv_reports]
        if self._report_type is not None:  # decoded as plain data: back to the connector's type
            reports = [msgspec.convert(r, self._report_type) for r in reports]
        sampler = results[self._sampling_rank]
        return StepResult(
            sampled=sampler.sampled,
            prompt_logprobs=sampler.prompt_logprobs,
            kv_reports=reports,
            collective_seconds=sampler.collective_seconds,
            stage_transfer_seconds=max(r.stage_transfer_seconds for r in results),
            forward_seconds=sampler.forward_seconds,
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
        if self._group is not None:
            for rank in range(self.size):
                with contextlib.suppress(WorkerGroupFailed):
                    self._group.send(rank, _STOP)
            self._group.close(timeout_s=10)
        if self._grammars is not None:
            self._grammars.shutdown()

    def kill(self) -> None:
        """Every rank ends now (a rank blocked in a collective hears nothing else)."""
        if self._group is not None:
            self._group.kill()

    # ---- talking to the ranks -----------------------------------------------------------

    def _send(self, rank: int, message: bytes) -> None:
        assert self._group is not None
        try:
            self._group.send(rank, message)
        except WorkerGroupFailed as exc:
            self._fail(str(exc))

    def _gather(self) -> list[bytes]:
        """One reply from every rank, in rank order; a rank that dies or fails ends the
        group (WorkerGroupFailed)."""
        assert self._group is not None
        replies: dict[int, bytes] = {}
        while len(replies) < self.size:
            try:
                ready = self._group.receive(set(range(self.size)) - set(replies))
            except WorkerGroupFailed as exc:
                self._fail(str(exc))
            for rank, data in ready:
                if data[:1] == _FAILED:
                    # A collective that fails is most often a peer that died: give the
                    # watcher a moment to name it, the cause rather than the symptom.
                    self._death_named.wait(DEATH_GRACE_S)
                    self._fail(f"rank {rank}: {data[1:].decode(errors='replace')}")
                replies[rank] = data[1:]
        return [replies[i] for i in range(self.size)]

    def _fail(self, reason: str) -> None:
        self._failure = self._failure or reason
        self.kill()
        raise WorkerGroupFailed(self._failure)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WorkerGroupFailed(self._failure)

    def _watch(self) -> None:
        """Between steps too: the first rank to die takes the group down at once."""
        assert self._group is not None
        died = self._group.wait_for_death()
        if died is None or self._closing.is_set():
            return
        rank, why = died
        reason = f"rank {rank} of the worker group died ({why})"
        logger.error("%s: stopping the group", reason)
        self._failure = self._failure or reason
        self._death_named.set()
        self.kill()
        if self.on_failure is not None:
            self.on_failure(reason)


def _dropped_here() -> list[DroppedFrames]:
    """What this rank's process dropped since its previous result: a rank always runs in
    a process of its own, so its book holds only its own sockets' drops."""
    return [DroppedFrames(c, r, n) for (c, r), n in DROPS.take_new().items()]


def run_rank(job: RankJob, channel: RankChannel) -> None:
    """A rank's life, wherever it runs: join the group, load its slice, report, then
    run each plan the driver sends until it says stop or goes away."""
    import torch.distributed as dist

    from pdserve.engine.pipeline import join_group
    from pdserve.engine.worker import ModelWorker

    config, rank = job.config, job.rank
    use_device(config.device)  # before NCCL, the model or any kernel touches CUDA
    try:
        config, tp, stage = join_group(config, rank, job.master, GROUP_TIMEOUT_S)
    except SecretError as exc:  # the driver names it in the group's failure, at once
        channel.send_bytes(_FAILED + f"{type(exc).__name__}: {exc}".encode())
        # Alive until the driver ends the group: it reads the reason, not an exit.
        with contextlib.suppress(EOFError, OSError):
            channel.recv_bytes()
        return
    factory = job.connector
    connector = factory(tp.rank, tp.size) if factory is not None else None
    metadata_type = getattr(factory, "metadata_type", None)
    worker = ModelWorker(config, connector, tp, stage)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepPlan)
    try:
        channel.send_bytes(_OK + encoder.encode(worker.load()))
        while True:
            try:
                message = channel.recv_bytes()
            except EOFError:
                break  # the driver is gone
            if message[:1] == _STOP:
                break
            plan = decoder.decode(message[1:])
            if plan.kv_connector is not None and metadata_type is not None:
                plan.kv_connector = msgspec.convert(plan.kv_connector, metadata_type)
            result = worker.execute(plan)
            result.dropped_frames = _dropped_here()
            channel.send_bytes(_OK + encoder.encode(result))
    except Exception as exc:  # reported to the driver, which ends the group
        logger.exception("rank %d failed", rank)
        channel.send_bytes(_FAILED + f"{type(exc).__name__}: {exc}".encode())
    finally:
        worker.shutdown()
        dist.destroy_process_group()
