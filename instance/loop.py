"""The runtime every instance kind shares: an `EngineCore` stepped in a loop, fed by tasks.

    runtime = ColocatedRuntime(spec)   # binds its sockets
    info = runtime.load()              # loads the weights (slow), starts the I/O thread
    runtime.run()                      # steps until stop() (another thread or a signal)

Each loop turn applies the tasks that came in, runs one engine step if there is work,
and sends one `InstanceOutput` with that step's token deltas, the instance's stats and
its metric deltas. The I/O thread (`InstanceIO`) sends heartbeats while the loop idles.

Instance kinds subclass `InstanceRuntime` and override its hooks:
- `on_generate(task)`: admit a GenerateTask (the prefill kind adds it with hand_off);
- `on_task(task)`: any task type the base does not know (e.g. a decode kind's handoff;
  `task_type` names the union its task socket decodes);
- `on_abort(task)`: the gateway ended requests (the KV kinds also drop transfers);
- `before_step()`: work between steps (e.g. polling KV-transfer reports);
- `after_step(deltas)`: act on a step's results (e.g. handing off requests that
  reached HANDED_OFF), returning the deltas to send;
- `has_work()`: whether the loop should step rather than wait for tasks;
- `task_wait_s()`: how long a loop turn may wait for tasks (e.g. short while transfers run);
- `step_engine()`: one engine step (the decode kind plans it itself to start pulls);
- `has_news()`: whether to send an output even without deltas (e.g. transfer counters);
- `collect_metrics(metrics)`: add kind-specific counters/histograms to an output;
- `send_to_instance(address, message)` (a helper, not a hook): a task to another
  instance, e.g. the prefill kind's handoff to its decode instance;
- `on_close()`: release kind-specific resources.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, ClassVar

import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.instance.io import InstanceIO
from pdserve.instance.spec import InstanceSpec
from pdserve.scheduler.messages import (
    AbortTask,
    GenerateTask,
    InspectTask,
    InstanceAddress,
    InstanceInfo,
    InstanceInspection,
    InstanceOutput,
    InstanceStats,
    LeakBlocksTask,
    MetricsDelta,
    RequestDelta,
    SnapshotTask,
    Task,
)
from pdserve.scheduler.request import Request
from pdserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class InstanceRuntime:
    role: ClassVar[str] = "colocated"
    task_type: ClassVar[Any] = Task

    def __init__(self, spec: InstanceSpec) -> None:
        if spec.role != self.role:
            raise ValueError(f"a {type(self).__name__} runs role {self.role!r}, not {spec.role!r}")
        self.spec = spec
        self.engine_config = EngineConfig.from_kwargs(**spec.engine)
        self.io = InstanceIO(
            spec.instance_id,
            spec.role,
            spec.gateway_address,
            spec.host,
            spec.heartbeat_interval_s,
            self.task_type,
        )
        self.engine: EngineCore | None = None
        self._stopped = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._counted = _CounterBaseline()
        self._pending_inspection: InstanceInspection | None = None
        self._pending_snapshot = None

    @property
    def address(self):
        return self.io.address

    # ---- lifecycle --------------------------------------------------------------------

    def load(self) -> InstanceInfo:
        """Loads the model and starts the I/O thread; returns what the gateway needs."""
        if self.spec.cpus:
            # Threads started from here on (torch's pool included) inherit the pinning.
            os.sched_setaffinity(0, self.spec.cpus)
        self.engine = EngineCore(self.engine_config)
        self._counted = _CounterBaseline.of(self.engine)
        self.io.start()
        return self.info()

    def info(self) -> InstanceInfo:
        engine = self._require_engine()
        return InstanceInfo(
            address=self.io.address,
            events_address=self.io.events_address,
            model_path=engine.model_path,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            block_size=self.engine_config.block_size,
            num_blocks=engine.scheduler.config.num_blocks,
            max_num_seqs=self.engine_config.max_num_seqs,
            generation_defaults=dict(engine.generation_config.defaults),
            pid=os.getpid(),
            kernels=engine.kernels_status(),
        )

    def run(self) -> None:
        """The step loop; returns after `stop()`, having sent what it owed."""
        self._require_engine()
        try:
            while not self._stopped.is_set():
                self.run_once()
        finally:
            self.close()

    def stop(self) -> None:
        """Thread-safe: the loop ends after its current step."""
        self._stopped.set()
        self.io.wake()

    def close(self) -> None:
        try:
            self.on_close()
        finally:
            self.io.close()

    def run_once(self) -> None:
        """One loop turn: tasks in, at most one step, one output out (when there is news)."""
        tasks = self.io.take_tasks(self.task_wait_s())
        deltas = [d for task in tasks if (d := self._apply(task)) is not None]
        self.before_step()
        if self.has_work():
            deltas.extend(self._step())
        deltas = self.after_step(deltas)
        self._publish_block_events()
        if tasks or deltas or self._pending_inspection or self._pending_snapshot or self.has_news():
            self._send(deltas)

    # ---- hooks for instance kinds -----------------------------------------------------

    def on_generate(self, task: GenerateTask) -> None:
        """Admits a request; raises ValueError when it cannot run here."""
        engine = self._require_engine()
        engine.add_request(self.make_request(task))

    def on_task(self, task: Any) -> RequestDelta | None:
        logger.warning("%s: ignoring a %s task", self.spec.instance_id, type(task).__name__)
        return None

    def on_abort(self, task: AbortTask) -> None:
        engine = self._require_engine()
        for request_id in task.request_ids:
            engine.abort_request(request_id)

    def before_step(self) -> None:
        pass

    def task_wait_s(self) -> float:
        return 0.0 if self.has_work() else self.spec.idle_wait_s

    def step_engine(self) -> list[RequestDelta]:
        return self._require_engine().step()

    def has_news(self) -> bool:
        return False

    def after_step(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        return deltas

    def has_work(self) -> bool:
        return self._require_engine().has_unfinished_requests()

    def collect_metrics(self, metrics: MetricsDelta) -> None:
        pass

    def on_close(self) -> None:
        pass

    # ---- helpers for kinds ------------------------------------------------------------

    def send_to_instance(self, address: InstanceAddress, message: msgspec.Struct) -> None:
        """Sends a message to another instance's task socket, through the I/O thread
        (e.g. the prefill kind's KVHandoff to `GenerateTask.decode_target`; the decode
        kind lists that type in its `task_type`)."""
        self.io.send_to_peer(address.task_address, self._encoder.encode(message))

    def make_request(self, task: GenerateTask) -> Request:
        params = task.sampling_params
        if params.seed != task.seed:
            params = msgspec.structs.replace(params, seed=task.seed)
        return self._require_engine().make_request(
            task.request_id, task.prompt_token_ids, params, task.cache_salt
        )

    def _require_engine(self) -> EngineCore:
        if self.engine is None:
            raise RuntimeError("the instance is not loaded yet: call load() first")
        return self.engine

    # ---- tasks ------------------------------------------------------------------------

    def _apply(self, task: Task) -> RequestDelta | None:
        engine = self._require_engine()
        if isinstance(task, GenerateTask):
            try:
                self.on_generate(task)
            except ValueError as exc:  # a request this instance cannot run
                return error_delta(task.request_id, str(exc), len(task.prompt_token_ids))
            except Exception as exc:  # a bug: fail the request, keep the instance serving
                logger.exception("%s: admitting %s failed", self.spec.instance_id, task.request_id)
                message = f"internal error: {type(exc).__name__}: {exc}"
                return error_delta(task.request_id, message, len(task.prompt_token_ids))
            return None
        if isinstance(task, AbortTask):
            self.on_abort(task)
        elif isinstance(task, SnapshotTask):
            self._pending_snapshot = engine.scheduler.block_cache_snapshot()
        elif isinstance(task, InspectTask):
            self._pending_inspection = self.inspect(task.query_id)
        elif isinstance(task, LeakBlocksTask):
            self._leak_blocks(task)
        else:
            return self.on_task(task)
        return None

    def inspect(self, query_id: str) -> InstanceInspection:
        scheduler = self._require_engine().scheduler
        try:
            scheduler.check_invariants()
            error = None
        except AssertionError as exc:
            error = str(exc) or "an invariant failed"
        bm = scheduler.block_manager
        return InstanceInspection(
            query_id=query_id,
            invariant_error=error,
            block_owners={b: sorted(owners) for b, owners in bm.owners().items()},
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.pool.num_cached_blocks,
            # quarantined: ended, but a transfer may still touch their blocks
            unfinished_request_ids=sorted({*scheduler.requests, *scheduler.quarantined}),
        )

    def _leak_blocks(self, task: LeakBlocksTask) -> None:
        if not self.spec.test_hooks:
            logger.warning("%s: LeakBlocksTask needs test hooks; ignored", self.spec.instance_id)
            return
        block_size = self.engine_config.block_size
        fake = Request(task.owner, [0] * (block_size * task.num_blocks), SamplingParams())
        self._require_engine().scheduler.block_manager.allocate_slots(
            fake, block_size * task.num_blocks
        )

    # ---- stepping and output ----------------------------------------------------------

    def _step(self) -> list[RequestDelta]:
        try:
            return self.step_engine()
        except Exception as exc:  # a broken step must not take the instance down
            logger.exception("%s: engine step failed", self.spec.instance_id)
            return self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")

    def _fail_all(self, message: str) -> list[RequestDelta]:
        engine = self._require_engine()
        deltas = []
        for request_id, request in list(engine.scheduler.requests.items()):
            engine.abort_request(request_id)
            deltas.append(
                error_delta(
                    request_id, message, request.num_prompt_tokens, request.num_output_tokens
                )
            )
        return deltas

    def _publish_block_events(self) -> None:
        batch = self._require_engine().scheduler.drain_block_events()
        if batch is not None:
            self.io.publish_events(self._encoder.encode(batch))

    def _send(self, deltas: list[RequestDelta]) -> None:
        engine = self._require_engine()
        metrics = self._counted.advance(engine, deltas)
        self.collect_metrics(metrics)
        output = InstanceOutput(
            instance=self.io.address,
            deltas=deltas,
            stats=self.stats(),
            metrics=metrics,
            inspection=self._pending_inspection,
            block_snapshot=self._pending_snapshot,
        )
        self._pending_inspection = self._pending_snapshot = None
        self.io.send_output(output)

    def stats(self) -> InstanceStats:
        scheduler = self._require_engine().scheduler
        s = scheduler.stats()
        bm = scheduler.block_manager
        return InstanceStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_waiting_for_remote_kvs=s.num_waiting_for_remote_kvs,
            num_held=s.num_held,
            queued_prefill_tokens=queued_prefill_tokens(scheduler),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_cache_usage_perc=s.kv_cache_usage_perc,
            num_preemptions_total=s.num_preemptions_total,
            prefix_cache_queries_total=s.prefix_cache_queries_total,
            prefix_cache_hits_total=s.prefix_cache_hits_total,
        )


def queued_prefill_tokens(scheduler) -> int:
    """Prompt tokens still to compute: waiting requests and running ones mid-prefill."""
    waiting = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
    running = sum(
        r.num_prompt_tokens - r.num_computed_tokens
        for r in scheduler.running
        if r.num_computed_tokens < r.num_prompt_tokens
    )
    return waiting + running


def error_delta(
    request_id: str, message: str, num_prompt_tokens: int = 0, output_index: int = 0
) -> RequestDelta:
    return RequestDelta(
        request_id=request_id,
        new_token_ids=[],
        output_index=output_index,
        finish_reason="error",
        num_prompt_tokens=num_prompt_tokens,
        error=message,
    )


class _CounterBaseline:
    """The engine's cumulative counters at the last output, to ship deltas."""

    def __init__(self, values: dict[str, float] | None = None) -> None:
        self.values = values or {}

    @classmethod
    def of(cls, engine: EngineCore) -> _CounterBaseline:
        return cls(_cumulative(engine))

    def advance(self, engine: EngineCore, deltas: list[RequestDelta]) -> MetricsDelta:
        now = _cumulative(engine)
        counters = {k: v - self.values.get(k, 0.0) for k, v in now.items()}
        self.values = now
        counters["generation_tokens_total"] = float(sum(len(d.new_token_ids) for d in deltas))
        counters["prompt_tokens_total"] = float(
            sum(d.num_prompt_tokens for d in deltas if d.output_index == 0 and d.new_token_ids)
        )
        return MetricsDelta(counters={k: v for k, v in counters.items() if v})


def _cumulative(engine: EngineCore) -> dict[str, float]:
    stats = engine.scheduler.stats()
    return {
        "num_preemptions_total": float(stats.num_preemptions_total),
        "prefix_cache_queries_total": float(stats.prefix_cache_queries_total),
        "prefix_cache_hits_total": float(stats.prefix_cache_hits_total),
        "prompt_tokens_computed_total": float(engine.stats.prompt_tokens_computed),
    }
