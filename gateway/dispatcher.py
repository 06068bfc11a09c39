"""The gateway's side of the instances: routes requests, sends tasks, receives outputs.

Sockets (all used from the event loop's thread):
- one PULL, bound here, that every instance's output PUSH connects to;
- one PUSH per instance, connected to the instance's task PULL;
- one SUB connected to every instance's block-event PUB (frame 0 names the instance).

Outputs are decoded as they arrive and their deltas handed to each request's
`RequestStream` (which orders them). The global scheduler hears every output (its
stats and heartbeats); an instance silent past the timeout, or reported gone by the
launcher, is taken out, and the requests that still need it are sent again or failed:
one whose stream has begun is migrated with the tokens its client already has as its
output, so the stream goes on at the next index (`_retry`). One silent or stalled
(a paused or hung process), or one that says it is unhealthy (its circuit breaker
tripped), is fenced: its epoch retired (whatever it sends later is dropped) and
`on_fenced` tells the cluster to kill it and start a replacement. A request whose step
failed on an instance moves on as `gateway/step_failures.py` says.

Every frame is sealed; what fails is dropped and counted before it is decoded, large
frames checked off the loop (`gateway/instance_frames.py`); every task names the
instance's epoch as the gateway knows it (`_send`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from pdserve.common.frame_seal import EVENTS, OUTPUTS
from pdserve.common.messages import (
    AbortTask,
    GenerateTask,
    InstanceInfo,
    InstanceInspection,
    InstanceOutput,
    RequestDelta,
    SnapshotTask,
    Task,
)
from pdserve.gateway.global_scheduler import (
    AdmissionRejected,
    GlobalScheduler,
    Route,
    handoffs_from,
)
from pdserve.gateway.inspections import Inspections
from pdserve.gateway.instance_frames import InstanceFrames
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.request_stream import RequestStream, StreamEvent
from pdserve.gateway.routing import RouteRequest
from pdserve.gateway.step_failures import next_move
from pdserve.gateway.timelines import Move, Timelines

logger = logging.getLogger(__name__)

LIVENESS_CHECK_INTERVAL_S = 0.5
_TASK_HWM = 100_000


class Dispatcher:
    def __init__(
        self,
        scheduler: GlobalScheduler,
        metrics: GatewayMetrics,
        host: str = "127.0.0.1",
        secret: bytes | None = None,
        timelines: Timelines | None = None,
    ) -> None:
        """`host`: where the output PULL binds; `secret`: the deployment's (default: from
        the environment); `timelines`: where requests' journeys are recorded."""
        self.scheduler = scheduler
        self.timelines = timelines or Timelines()
        self._frames = InstanceFrames(secret, metrics.dropped_frames.own)
        self.metrics = metrics
        self.context = zmq.asyncio.Context()
        self._output_socket = self.context.socket(zmq.PULL)
        self._output_socket.setsockopt(zmq.MAXMSGSIZE, OUTPUTS.max_message_bytes)
        port = self._output_socket.bind_to_random_port(f"tcp://{host}")
        self.output_address = f"tcp://{host}:{port}"
        self._event_socket = self.context.socket(zmq.SUB)
        self._event_socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._event_socket.setsockopt(zmq.MAXMSGSIZE, EVENTS.max_message_bytes)
        self._push_context = zmq.Context()  # plain sockets: sends never wait
        self._task_sockets: dict[str, zmq.Socket] = {}
        self.streams: dict[str, RequestStream] = {}
        self._tasks: dict[str, GenerateTask] = {}
        self._inspections = Inspections()
        self._snapshot_requested: set[str] = set()
        self._background: list[asyncio.Task] = []
        self.on_instance_lost: Callable[[str, str], None] | None = None
        # The cluster's: kills a fenced instance and starts its replacement.
        self.on_fenced: Callable[[str], None] | None = None

    # ---- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Starts the receiving tasks on the running loop."""
        for coroutine in (self._receive_outputs(), self._receive_events(), self._watch()):
            self._background.append(asyncio.get_running_loop().create_task(coroutine))

    async def close(self) -> None:
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sock in self._task_sockets.values():
            sock.close(linger=0)
        self._output_socket.close(linger=0)
        self._event_socket.close(linger=0)
        self._push_context.term()
        self.context.term()

    # ---- instances --------------------------------------------------------------------

    def register(self, info: InstanceInfo) -> None:
        """A ready instance joins routing: a new one, or a dead one's restarted process."""
        instance_id = info.address.instance_id
        restarted = instance_id in self.scheduler.views
        if restarted:
            self._disconnect(instance_id)  # the old process's sockets and clock went with it
            self.timelines.forget_instance(instance_id)
        self.scheduler.add_instance(info, time.monotonic())
        self._connect(info)
        if restarted:
            logger.warning("instance %s restarted (epoch %d): re-admitted", instance_id, info.epoch)
            self.metrics.restarted.inc()

    def _disconnect(self, instance_id: str) -> None:
        sock = self._task_sockets.pop(instance_id, None)
        if sock is not None:
            sock.close(linger=0)
        view = self.scheduler.views.get(instance_id)
        if view is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._event_socket.disconnect(view.info.events_address)
        self._snapshot_requested.discard(instance_id)

    def _connect(self, info: InstanceInfo) -> None:
        instance_id = info.address.instance_id
        self._connect_tasks(info)
        self._event_socket.connect(info.events_address)
        self.metrics.add_instance(info.address.role, instance_id)
        self._request_snapshot(instance_id)

    def _connect_tasks(self, info: InstanceInfo) -> None:
        if info.address.instance_id in self._task_sockets:
            return
        sock = self._push_context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, _TASK_HWM)
        sock.connect(info.address.task_address)
        self._task_sockets[info.address.instance_id] = sock

    def role_of(self, instance_id: str) -> str:
        view = self.scheduler.views.get(instance_id)
        return view.role if view else "unknown"

    def instance_lost(self, instance_id: str, reason: str) -> None:
        """Takes a dead instance out; retries or fails the requests that still need it."""
        view = self.scheduler.views.get(instance_id)
        if view is None:
            return
        failover = self.scheduler.mark_dead(instance_id)
        self._disconnect(instance_id)
        if failover.already_dead:
            return
        logger.warning("instance %s is gone: %s", instance_id, reason)
        self.metrics.mark_down(view.role, instance_id)
        for (other, prefill_id), request_ids in failover.abort.items():
            self._send(other, AbortTask(request_ids, handoffs_from=prefill_id))
        retries = self.scheduler.config.max_attempts - 1
        for request_id in failover.fail:
            message = f"instance {instance_id} failed mid-request: {reason}"
            if request_id in failover.exhausted:
                message += f" (no retries left: --max-request-retries {retries})"
            self._fail(request_id, message)
        for request_id in failover.retry:
            self._retry(request_id, f"instance {instance_id} failed mid-request: {reason}")
        self._inspections.forget(instance_id)
        if self.on_instance_lost is not None:
            self.on_instance_lost(instance_id, reason)

    # ---- requests ---------------------------------------------------------------------

    def submit(self, task: GenerateTask, sink: Callable[[StreamEvent], None]) -> RequestStream:
        """Routes and sends a request; raises AdmissionRejected when no instance can."""
        request = RouteRequest(task.request_id, task.prompt_token_ids, task.cache_salt)
        route = self.scheduler.route(request)
        self.scheduler.assign(request, route)
        stream = RequestStream(task.request_id, sink)
        self.streams[task.request_id] = stream
        self._tasks[task.request_id] = task
        self._dispatch(task, route)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Ends requests everywhere (client gone, stop string matched); idempotent."""
        per_instance: dict[tuple[str, str], list[str]] = {}
        for request_id in request_ids:
            stream = self.streams.pop(request_id, None)
            if stream is not None:
                stream.end()
            self._tasks.pop(request_id, None)
            assignment = self.scheduler.finish(request_id)
            if assignment is None:
                continue
            for view in assignment.route.instances:
                if view.alive:
                    key = (view.instance_id, handoffs_from(assignment.route, view))
                    per_instance.setdefault(key, []).append(request_id)
        for (instance_id, prefill_id), ids in per_instance.items():
            self._send(instance_id, AbortTask(ids, handoffs_from=prefill_id))

    def _dispatch(self, task: GenerateTask, route: Route, move: Move | None = None) -> None:
        self.timelines.dispatched(task.request_id, route, move)
        if route.prefill is not None:
            target, epoch = route.decode.info.address, route.decode.epoch
            task = msgspec.structs.replace(task, decode_target=target, decode_epoch=epoch)
        elif task.decode_target is not None:
            task = msgspec.structs.replace(task, decode_target=None, decode_epoch=0)
        self._send(route.first.instance_id, task)

    def _step_failed(self, instance_id: str, delta: RequestDelta) -> None:
        """The instance dropped the request after a failed step: elsewhere, or the end."""
        rid, task = delta.request_id, self._tasks.get(delta.request_id)
        assignment, view = self.scheduler.assignments.get(rid), self.scheduler.views[instance_id]
        if task is None or assignment is None or rid not in view.in_flight:
            return  # e.g. a prefill instance's news of a request its decode instance has
        route = assignment.route
        for other in route.instances:
            if other is not view and other.alive:
                self._send(other.instance_id, AbortTask([rid], handoffs_from(route, other)))
        attempts, most = assignment.attempts, self.scheduler.config.max_attempts
        move = next_move(task, delta, instance_id, attempts, most)
        if move.task is None:
            return self._fail(rid, move.fail)
        self._tasks[rid] = move.task
        self._retry(rid, move.why, avoid=frozenset({instance_id}))

    def _retry(self, request_id: str, why: str, avoid: frozenset[str] = frozenset()) -> None:
        """Sends a request whose instance died again. With no token released to its
        client yet it starts over on any route; otherwise it is migrated: its released
        tokens ride as output to one instance that computes prompt and output and
        samples from the next index (seeded sampling is keyed on the index, so the
        stream goes on as it would have)."""
        assignment = self.scheduler.assignments.get(request_id)
        task = self._tasks.get(request_id)
        stream = self.streams.get(request_id)
        if assignment is None or task is None or stream is None:
            return
        output = list(stream.token_ids)
        try:
            route = self.scheduler.route(assignment.request, not output, avoid)
        except AdmissionRejected as exc:
            self._fail(request_id, f"{why}; no instance left to send it to: {exc}")
            return
        self.scheduler.assign(assignment.request, route)
        stream.resend()
        (self.metrics.migrated if output else self.metrics.retried).inc()
        what = f"migrating after {len(output)} tokens" if output else "retrying"
        logger.info("%s %s on %s", what, request_id, route.first.instance_id)
        move = ("migration" if output else "retry", why, len(output))
        self._dispatch(msgspec.structs.replace(task, output_token_ids=output), route, move)

    def _fail(self, request_id: str, message: str) -> None:
        self.scheduler.finish(request_id)
        self._tasks.pop(request_id, None)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.fail(message, time.perf_counter())

    def _send(self, instance_id: str, task: Task) -> bool:
        """Sends a task naming the instance's epoch as this gateway knows it now: the
        instance drops one that reaches another life of it (`instance/task_epochs.py`)."""
        sock = self._task_sockets.get(instance_id)
        view = self.scheduler.views.get(instance_id)
        if sock is None or view is None:
            return False
        task = msgspec.structs.replace(task, epoch=view.epoch)
        try:
            sock.send(self._frames.seal_task(task), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("instance %s is not reading its tasks; one dropped", instance_id)
            return False
        return True

    # ---- debugging and tests ----------------------------------------------------------

    async def inspect(self, timeout_s: float = 10.0) -> dict[str, InstanceInspection | None]:
        """Every live instance's books (None for one that did not answer in time)."""
        live = [v.instance_id for v in self.scheduler.views.values() if v.alive]
        return await self._inspections.ask(live, self._send, timeout_s)

    def send_task(self, instance_id: str, task: Task) -> bool:
        """A test hook's task, or a role switch's (its last output `_on_output` takes);
        False: no such instance."""
        return self._send(instance_id, task)

    def migrate(self, request_id: str, why: str, avoid: frozenset[str]) -> None:
        """Sends on a request its instance gives up alive (a role switch), as `_retry`."""
        self._retry(request_id, why, avoid)

    # ---- receiving --------------------------------------------------------------------

    async def _receive_outputs(self) -> None:
        while True:
            output = await self._frames.open_output(await self._output_socket.recv())
            if output is None:
                continue
            try:
                self._on_output(output, time.perf_counter())
            except Exception:  # one bad output must not stop the receiver
                logger.exception("failed to handle an output of %s", output.instance.instance_id)

    def _on_output(self, output: InstanceOutput, arrival: float) -> None:
        instance_id = output.instance.instance_id
        now = time.monotonic()
        if output.switched and (old := self.scheduler.switch_role(output.switched, now)):
            self.metrics.move_instance(old, output.instance.role, instance_id)  # a new pool
        # Unregistered, dead, or of a retired epoch (a fenced one resumed): none of it counts.
        if not self.scheduler.observe(
            instance_id, output.stats, now, output.epoch, output.loop_turns
        ):
            return
        self.metrics.record_output(output)
        wall = self.timelines.observe_output(instance_id, output.sent_at)
        for delta in output.deltas:
            self._on_delta(instance_id, delta, arrival, wall)
        if output.unhealthy:
            self.fence(instance_id, f"it reports itself unhealthy: {output.unhealthy}")
            return
        if output.inspection is not None:
            self._inspections.answer(instance_id, output.inspection)
        if output.block_snapshot is not None:
            self._snapshot_requested.discard(instance_id)
            if not self.scheduler.apply_snapshot(instance_id, output.block_snapshot):
                self._request_snapshot(instance_id)

    def _on_delta(self, instance_id: str, delta: RequestDelta, arrival: float, wall: float) -> None:
        request_id = delta.request_id
        stream = self.streams.get(request_id)
        assignment = self.scheduler.assignments.get(request_id)
        if stream is None or assignment is None:
            return  # ended here already (aborted, stop string, failed over)
        if all(view.instance_id != instance_id for view in assignment.route.instances):
            return  # from an instance the request was moved away from
        if delta.step_failed:
            self._step_failed(instance_id, delta)
            return
        self.timelines.delta(request_id, instance_id, wall, delta.timings)
        if delta.new_token_ids:
            self.scheduler.mark_started(request_id)
        if instance_id == assignment.route.decode.instance_id:
            self.scheduler.release_prefill(request_id)
        if stream.push(delta, instance_id, arrival):
            self.streams.pop(request_id, None)
            self._tasks.pop(request_id, None)
            self.scheduler.finish(request_id)

    async def _receive_events(self) -> None:
        while True:
            opened = await self._frames.open_events(await self._event_socket.recv_multipart())
            if opened is None:
                continue
            instance_id, batch = opened
            if not self.scheduler.apply_block_events(instance_id, batch):
                self._request_snapshot(instance_id)

    def _request_snapshot(self, instance_id: str) -> None:
        if instance_id not in self._snapshot_requested and self._send(instance_id, SnapshotTask()):
            self._snapshot_requested.add(instance_id)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(LIVENESS_CHECK_INTERVAL_S)
            config, now = self.scheduler.config, time.monotonic()
            for instance_id in self.scheduler.find_silent(now):
                reason = f"no output or heartbeat for {config.instance_timeout_s:g} s"
                self.fence(instance_id, reason)
            for instance_id in self.scheduler.find_stalled(now):
                reason = f"its step loop made no progress for {config.instance_stall_timeout_s:g} s"
                self.fence(instance_id, reason)

    def fence(self, instance_id: str, reason: str) -> None:
        """An instance whose process may live on (paused, hung) is taken out as if dead
        and its epoch retired; the cluster kills it and starts a replacement in the next
        epoch (`on_fenced`). Without a cluster (a bare gateway) it stays out."""
        role = self.role_of(instance_id)
        self.instance_lost(instance_id, f"fenced: {reason}")
        self.metrics.fenced.labels(role, instance_id).inc()
        if self.on_fenced is not None:
            self.on_fenced(instance_id)
