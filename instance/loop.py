"""The instance process's step loop: an `EngineCore` stepped in a loop, fed by tasks.

    loop = StepLoop(spec)     # binds its sockets; the role comes from spec.role
    info = loop.load()        # loads the weights (slow), starts the I/O thread
    loop.run()                # steps until stop() (another thread or a signal)

Each loop turn, top to bottom:
1. take the tasks that came in (`InstanceIO`; waits while there is nothing to step);
2. apply them: `GenerateTask` → `role.admit`, `AbortTask` → `role.abort`, snapshots
   and inspections here, a test hook's task through `TestHooks`, anything else →
   `role.on_task` (e.g. a decode role's `KVHandoff`);
3. `role.before_step()` (e.g. KV-transfer reports acted on);
4. one `role.step()` if `role.has_work()`;
5. `role.after_step(deltas)` (e.g. a prefill role's handoffs);
6. the scheduler's block events out on the PUB socket;
7. a role switch the gateway asked for, once the old role holds nothing
   (`instance/role_switch.py`);
8. one `InstanceOutput` (token deltas, stats, metric deltas) when there is news.

The role object is the only thing that differs between colocated, prefill and decode
instances (instance/kinds.py). The I/O thread sends heartbeats while the loop idles.

A step that raises fails the requests it touched (held handoffs aside), which the
gateway sends on elsewhere (`RequestDelta.step_failed`); requests that already failed
a step elsewhere run here one at a time (`instance/probation.py`), and steps that keep
failing trip the circuit breaker (`instance/breaker.py`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import msgspec

from pdserve.common import messages as wire
from pdserve.common.block_events import BlockCacheSnapshot
from pdserve.engine.core import EngineCore, default_executor
from pdserve.engine.executor import Executor
from pdserve.engine.ranks import RankLauncher, WorkerGroupFailed
from pdserve.engine.step_plan import KVGeometry
from pdserve.instance.breaker import StepBreaker
from pdserve.instance.hooks import TestHooks
from pdserve.instance.io import InstanceIO
from pdserve.instance.kinds import Role, role_kind
from pdserve.instance.probation import Probation
from pdserve.instance.reporting import CounterBaseline, inspect_scheduler, instance_stats
from pdserve.instance.role_switch import RoleSwitch
from pdserve.instance.spec import InstanceSpec
from pdserve.kvtransfer.link import KVLink

logger = logging.getLogger(__name__)


class StepLoop:
    def __init__(
        self,
        spec: InstanceSpec,
        executor: Executor | None = None,
        ranks: RankLauncher | None = None,
    ) -> None:
        """`executor`: the ranks behind the seam (default: one rank in this process,
        with the role's KV connector beside its cache, or a worker group whose ranks
        `ranks` starts: child processes unless told otherwise)."""
        self.spec: InstanceSpec = spec
        self.kind = role_kind(spec.role)
        self.engine_config = spec.engine
        self.executor = executor or default_executor(
            self.engine_config, self.kind.connector(spec), self._on_group_failure, ranks
        )
        self.hooks = TestHooks() if spec.test_hooks else None
        # Set when a rank of the executor's worker group died: the instance ends.
        self.failure: str | None = None
        self.io = InstanceIO(
            instance_id=spec.instance_id,
            role=spec.role,
            gateway_address=spec.gateway_address,
            host=spec.host,
            heartbeat_interval_s=spec.heartbeat_interval_s,
            task_type=self.kind.task_type,
            epoch=spec.epoch,
        )
        self.breaker = StepBreaker()
        self.probation = Probation()
        self.engine: EngineCore | None = None
        self.role: Role | None = None
        self.link: KVLink | None = None  # built by the first role that moves KV
        self.on_role: Callable[[str], None] | None = None  # told each new role (ps title)
        self._stopped = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._counted = CounterBaseline()
        self._pending_inspection: wire.InstanceInspection | None = None
        self._pending_snapshot: BlockCacheSnapshot | None = None
        self._switch = RoleSwitch(self)
        self._switched: wire.InstanceInfo | None = None

    @property
    def address(self) -> wire.InstanceAddress:
        return self.io.address

    # ---- lifecycle --------------------------------------------------------------------

    def load(self) -> wire.InstanceInfo:
        """Loads the model and starts the I/O thread; returns what the gateway needs."""
        if self.spec.cpus:
            # Threads started from here on (torch's pool included) inherit the pinning.
            os.sched_setaffinity(0, self.spec.cpus)
        self.engine = EngineCore(self.engine_config, self.executor)
        self.role = self.kind.build(self)
        self._counted = CounterBaseline.of(self.engine)
        self.io.start()
        return self.info()

    def info(self) -> wire.InstanceInfo:
        engine = self.require_engine()
        return wire.InstanceInfo(
            address=self.io.address,
            events_address=self.io.events_address,
            model_path=engine.model_path,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            block_size=self.engine_config.block_size,
            num_blocks=engine.scheduler.config.num_blocks,
            max_num_seqs=self.engine_config.max_num_seqs,
            generation_defaults=dict(engine.info.generation_defaults),
            pid=os.getpid(),
            kernels=engine.kernels_status(),
            dtype=engine.info.dtype or engine.info.kv.dtype,
            device=self.engine_config.device,
            kv_cache_dtype=engine.info.kv.dtype,
            kv_scales=kv_scale_source(engine.info.kv, self.engine_config.calculate_kv_scales),
            kv_bytes_per_token=engine.info.kv.bytes_per_token(
                self.engine_config.tensor_parallel_size
            ),
            weight_bytes=engine.info.weight_bytes,
            quantization=self.engine_config.quantization or engine.info.weight_format,
            epoch=self.io.epoch,
        )

    def run(self) -> str | None:
        """The step loop; returns after `stop()`, having sent what it owed, or after its
        worker group was lost: then with the reason (the launcher's news of its end)."""
        self.require_role()
        try:
            while not self._stopped.is_set():
                self.run_once()
        finally:
            self.close()
        return None if self.failure is None else f"it lost its worker group: {self.failure}"

    def stop(self) -> None:
        """Thread-safe: the loop ends after its current step."""
        self._stopped.set()
        self.io.wake()

    def close(self) -> None:
        try:
            self.executor.shutdown()
        finally:
            self.io.close()

    def run_once(self) -> None:
        """One loop turn: tasks in, at most one step, one output out (when there is news)."""
        role = self.require_role()
        if self.failure is not None:
            self._end_after_failure()
            return
        tasks = self.io.take_tasks(role.task_wait_s(self.spec.idle_wait_s))
        deltas = [d for got in tasks if (d := self._apply(got.task, got.at)) is not None]
        role.before_step()
        if role.has_work():
            deltas.extend(self._step(role))
        deltas = role.after_step(deltas)
        self._publish_block_events()
        if self._switch.ready():
            self.flush(deltas)  # the old role's last news, in the old epoch
            self._switched, deltas, role = self._switch.apply(), [], self.require_role()
        pending = self._pending_inspection or self._pending_snapshot or self._switched
        if tasks or deltas or pending or role.has_news():
            self.flush(deltas)
        self.io.loop_turns += 1  # only this thread writes it

    # ---- what roles get from the loop -------------------------------------------------

    def send_to_instance(self, address: wire.InstanceAddress, message: msgspec.Struct) -> None:
        """A message to another instance's task socket, through the I/O thread (e.g. a
        prefill role's KVHandoff to `GenerateTask.decode_target`)."""
        self.io.send_to_peer(address.task_address, self._encoder.encode(message))

    def flush(self, deltas: list[wire.RequestDelta]) -> None:
        """Sends one output now: the deltas, the instance's stats and metric deltas."""
        engine = self.require_engine()
        role = self.require_role()
        metrics = self._counted.advance(engine, deltas)
        role.add_metrics(metrics)
        stats = instance_stats(engine.scheduler)
        role.add_stats(stats)
        output = wire.InstanceOutput(
            instance=self.io.address,
            deltas=deltas,
            epoch=self.io.epoch,
            loop_turns=self.io.loop_turns,
            unhealthy=self.io.unhealthy,
            stats=stats,
            metrics=metrics,
            inspection=self._pending_inspection,
            block_snapshot=self._pending_snapshot,
            sent_at=time.time(),
            switched=self._switched,
        )
        self._pending_inspection = self._pending_snapshot = self._switched = None
        self.io.send_output(output)

    def require_engine(self) -> EngineCore:
        if self.engine is None:
            raise RuntimeError("the instance is not loaded yet: call load() first")
        return self.engine

    def require_role(self) -> Role:
        if self.role is None:
            raise RuntimeError("the instance is not loaded yet: call load() first")
        return self.role

    # ---- tasks ------------------------------------------------------------------------

    def _apply(self, task: wire.Task, received_at: float) -> wire.RequestDelta | None:
        """`received_at`: when the I/O thread decoded it (a request's queue starts there)."""
        role = self.require_role()
        if isinstance(task, wire.GenerateTask):
            if not self.probation.admit(task):
                return None
            return self._admit(role, task, received_at)
        if isinstance(task, wire.AbortTask):
            self.probation.drop(task.request_ids)
            role.abort(task)
        elif isinstance(task, wire.SnapshotTask):
            self._pending_snapshot = self.require_engine().scheduler.block_cache_snapshot()
        elif isinstance(task, wire.InspectTask):
            self._pending_inspection = inspect_scheduler(
                self.require_engine().scheduler, task.query_id
            )
        elif isinstance(task, wire.LeakBlocksTask):
            if self.hooks is None:
                logger.warning(
                    "%s: LeakBlocksTask needs test hooks; ignored", self.spec.instance_id
                )
            else:
                self.hooks.leak_blocks(self.require_engine(), task)
        elif isinstance(task, wire.FailStepsTask):
            if self.hooks is not None:
                self.hooks.fail_steps(task)
        elif isinstance(task, wire.SwitchRoleTask):
            try:
                self._switch.request(task)
            except ValueError as exc:  # the gateway checks first: this is a bug there
                logger.error("%s: role switch refused: %s", self.spec.instance_id, exc)
        else:
            return role.on_task(task, received_at)
        return None

    def _admit(
        self, role: Role, task: wire.GenerateTask, received_at: float | None = None
    ) -> wire.RequestDelta | None:
        """`received_at`: None for a task held back (on probation) since it came in."""
        try:
            role.admit(task, received_at)
        except ValueError as exc:  # a request this instance cannot run
            return wire.error_delta(task.request_id, str(exc), len(task.prompt_token_ids))
        except Exception as exc:  # a bug: fail the request, keep the instance serving
            logger.exception("%s: admitting %s failed", self.spec.instance_id, task.request_id)
            message = f"internal error: {type(exc).__name__}: {exc}"
            return wire.error_delta(task.request_id, message, len(task.prompt_token_ids))
        return None

    # ---- stepping ---------------------------------------------------------------------

    def _step(self, role: Role) -> list[wire.RequestDelta]:
        try:
            if self.hooks is not None:
                self.hooks.before_step(self.require_engine())
            deltas = role.step()
        except WorkerGroupFailed as exc:  # the ranks are gone: this instance cannot go on
            self.failure = str(exc)
            return []  # its requests go on elsewhere once it exited (`_end_after_failure`)
        except Exception as exc:  # a broken step must not take the instance down
            logger.exception("%s: engine step failed", self.spec.instance_id)
            return self._fail_step(f"engine step failed: {type(exc).__name__}: {exc}")
        self.breaker.record_success()
        return deltas + self._admit_cleared(role)

    def _admit_cleared(self, role: Role) -> list[wire.RequestDelta]:
        """The next request on probation, once the one on trial was cleared or blamed."""
        deltas = []
        for task in self.probation.clear(self.require_engine().scheduler):
            if (delta := self._admit(role, task)) is not None:
                deltas.append(delta)
        return deltas

    def _fail_step(self, reason: str) -> list[wire.RequestDelta]:
        """Drops the failed step's requests. One on probation here is blamed and ends
        (its second failed step); the others go elsewhere (suspects, or bystanders when
        one on probation was blamed), and only an unexplained failure counts toward the
        breaker."""
        suspect = self.probation.blame()
        deltas = self._fail_all(reason, wire.STEP_BYSTANDER if suspect else wire.STEP_SUSPECT)
        for delta in deltas:
            if delta.request_id == suspect:
                delta.step_failed = ""
                delta.error = f"{reason} (a step with it failed on 2 instances)"
        if suspect is None and self.breaker.record_failure(reason) and not self.io.unhealthy:
            self.io.unhealthy = self.breaker.tripped
            logger.error("%s: circuit breaker tripped: %s", self.spec.instance_id, reason)
        if suspect is not None:
            deltas += self._admit_cleared(self.require_role())
        return deltas

    def _on_group_failure(self, reason: str) -> None:
        """From the executor's watcher thread: a rank died between steps."""
        self.failure = reason
        self.io.wake()

    def _end_after_failure(self) -> None:
        """Stops the loop (the process then exits 1) without failing a request: its exit
        is the launcher's news, and the gateway sends the requests that still need this
        instance elsewhere (retried, or migrated with their output so far) within
        `--max-request-retries`; the supervisor starts a new instance with new ranks."""
        logger.error(
            "%s: lost its worker group: %s; exiting so that its requests go on elsewhere",
            self.spec.instance_id,
            self.failure,
        )
        self._stopped.set()

    def _fail_all(self, message: str, step_failed: str) -> list[wire.RequestDelta]:
        """Ends every request the step touched: not the handed-off ones, whose compute
        is done and whose blocks their decode instance may be pulling."""
        engine = self.require_engine()
        held = engine.scheduler.held
        deltas = []
        for request_id, request in list(engine.scheduler.requests.items()):
            if request_id in held:
                continue
            engine.abort_request(request_id)
            delta = wire.error_delta(
                request_id, message, request.num_prompt_tokens, request.num_output_tokens
            )
            delta.step_failed = step_failed
            deltas.append(delta)
        return deltas

    def _publish_block_events(self) -> None:
        batch = self.require_engine().scheduler.drain_block_events()
        if batch is not None:
            self.io.publish_events(self._encoder.encode(batch))


def kv_scale_source(kv: KVGeometry, calculated: bool) -> str:
    """Where an FP8 cache's scales come from, for the ready line ("" for no FP8 cache)."""
    if not kv.k_scales:
        return ""
    if calculated:
        return "measured at load"
    return "1.0" if set(kv.k_scales + kv.v_scales) == {1.0} else "the checkpoint's"
