"""An instance's I/O thread: tasks in, outputs and block events out, heartbeats.

Sockets (ZMQ; every one is used by this thread only):
- task PULL, bound on the instance's host at a free port: the gateway's PUSH connects;
- output PUSH, connected to the gateway's PULL (one PULL for all instances);
- block-event PUB, bound at a free port: the gateway's SUB connects; each message is
  [instance id, msgpack BlockEventBatch];
- an inproc PAIR fed by the step loop with encoded outputs and event batches.

Every frame on a TCP socket is sealed (`pdserve.common.frame_seal`): a task that fails
its seal (or does not decode) is dropped and counted before it is decoded, one of the
gateway's for another epoch of this instance after (`instance/task_epochs.py`), and outputs,
events and handoffs to peers leave sealed under the instance's id. What the process
dropped rides to the gateway with the next heartbeat (`MetricsDelta.dropped_frames`).
A peer's PUSH (handoffs to a decode instance) is closed once it has been idle for
`PEER_IDLE_S`, so restarted peers on new ports leave no sockets behind.

Running them on a thread of their own means a long model step never delays a task, an
abort or a heartbeat: the gateway hears from the instance every `heartbeat_interval_s`
even mid-step (torch releases the GIL while it computes).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from itertools import count
from typing import Any

import msgspec
import zmq

from pdserve.common import frame_drops
from pdserve.common.frame_drops import DROPS
from pdserve.common.frame_seal import EVENTS, OUTPUTS, TASKS, Sealer
from pdserve.common.messages import (
    AddressedTask,
    DroppedFrames,
    InstanceAddress,
    InstanceOutput,
    InstanceStats,
    MetricsDelta,
    Task,
)
from pdserve.instance.task_epochs import TaskEpochs

logger = logging.getLogger(__name__)

_KIND_OUTPUT = b"out"
_KIND_EVENTS = b"events"
_KIND_PEER = b"peer"
_OUTPUT_HWM = 100_000  # messages queued for a gateway that is slow or gone
_CLOSE_LINGER_MS = 500
PEER_IDLE_S = 60.0  # a peer's PUSH unused this long is closed (its peer may be gone)
_instance_numbers = count()


@dataclass(frozen=True)
class Received:
    """A task as this thread decoded it, and when (`time.monotonic()`, the clock the
    scheduler stamps requests on): a request's queue starts here, so its wait in the
    inbox while a step runs is queue time, not a gap before it."""

    task: Any
    at: float


class InstanceIO:
    def __init__(
        self,
        instance_id: str,
        role: str,
        gateway_address: str,
        host: str = "127.0.0.1",
        heartbeat_interval_s: float = 0.5,
        task_type: Any = Task,
        secret: bytes | None = None,
        epoch: int = 0,
    ) -> None:
        """`task_type`: the union the task socket decodes (a kind may accept more than
        `pdserve.common.messages.Task`, e.g. the decode kind's handoffs); `secret`:
        the deployment's (default: from the environment); `epoch`: the one the instance
        starts in."""
        self.heartbeat_interval_s = heartbeat_interval_s
        self._task_opener = Sealer(TASKS, instance_id, responder=True, secret=secret)
        self._task_sealer = Sealer(TASKS, instance_id, secret=secret)  # handoffs to peers
        self._output_sealer = Sealer(OUTPUTS, instance_id, secret=secret)
        self._event_sealer = Sealer(EVENTS, instance_id, secret=secret)
        self.context = zmq.Context()
        self._task_socket = self.context.socket(zmq.PULL)
        self._task_socket.setsockopt(zmq.MAXMSGSIZE, TASKS.max_message_bytes)
        task_port = self._task_socket.bind_to_random_port(f"tcp://{host}")
        self._event_socket = self.context.socket(zmq.PUB)
        event_port = self._event_socket.bind_to_random_port(f"tcp://{host}")
        self._output_socket = self.context.socket(zmq.PUSH)
        self._output_socket.setsockopt(zmq.SNDHWM, _OUTPUT_HWM)
        self._output_socket.connect(gateway_address)
        inproc = f"inproc://instance-outbox-{next(_instance_numbers)}"
        self._outbox_rx = self.context.socket(zmq.PAIR)
        self._outbox_rx.bind(inproc)
        self._outbox_tx = self.context.socket(zmq.PAIR)  # the step loop's end
        self._outbox_tx.connect(inproc)
        self.address = InstanceAddress(instance_id, role, f"tcp://{host}:{task_port}")
        self.events_address = f"tcp://{host}:{event_port}"
        # Frame 0 of every event message: one SUB socket at the gateway hears them all.
        self._topic = instance_id.encode()
        self._tasks: collections.deque[Received] = collections.deque()
        self._task_ready = threading.Event()
        self._stopping = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(task_type)
        self._left: msgspec.msgpack.Decoder | None = None  # the tasks of the role it left
        self._encoder = msgspec.msgpack.Encoder()
        self.latest_stats: InstanceStats | None = None  # set by the step loop, read here
        # Switched by the step loop, read here: outputs' epoch and the tasks taken.
        self.epochs = TaskEpochs(epoch)
        # Set by the step loop, read here (a plain int: one assignment is atomic).
        self.loop_turns = 0
        self.unhealthy = ""  # why the instance cannot serve (its breaker tripped)
        self._peer_sockets: dict[bytes, zmq.Socket] = {}  # the I/O thread's, by task address
        self._peer_used: dict[bytes, float] = {}  # when each was last sent on
        self._last_sent = 0.0
        self._last_drop_report = 0.0
        self._thread = threading.Thread(target=self._run, name=f"io-{instance_id}", daemon=True)

    @property
    def epoch(self) -> int:
        """The epoch the instance's outputs and heartbeats carry."""
        return self.epochs.current

    # ---- the step loop's side ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def take_tasks(self, timeout_s: float) -> list[Received]:
        """Every task received so far; waits up to `timeout_s` when there is none."""
        if not self._tasks:
            self._task_ready.wait(timeout_s)
        self._task_ready.clear()
        tasks = []
        while self._tasks:
            tasks.append(self._tasks.popleft())
        return tasks

    def wake(self) -> None:
        """Ends a `take_tasks` wait early (shutdown)."""
        self._task_ready.set()

    def change_role(self, role: str, task_type: Any) -> None:
        """The instance serves as `role` from now on: outputs and heartbeats say so, and
        the task socket decodes that role's tasks (each a single assignment, which the
        I/O thread sees whole). A peer's message still in flight for the role it left
        (a handoff) decodes with that role's types, to be counted as stale."""
        self._decoder, self._left = msgspec.msgpack.Decoder(task_type), self._decoder
        self.address = InstanceAddress(self.address.instance_id, role, self.address.task_address)

    def send_output(self, output: InstanceOutput) -> None:
        if output.stats is not None:
            self.latest_stats = output.stats
        self._outbox_tx.send_multipart([_KIND_OUTPUT, self._encoder.encode(output)])

    def publish_events(self, payload: bytes) -> None:
        self._outbox_tx.send_multipart([_KIND_EVENTS, payload])

    def send_to_peer(self, task_address: str, payload: bytes) -> None:
        """Sends an encoded task to another instance's task socket (e.g. a prefill
        instance's handoff to its decode instance); the I/O thread keeps one PUSH per
        peer, so messages to one peer stay in order."""
        self._outbox_tx.send_multipart([_KIND_PEER, task_address.encode(), payload])

    def close(self) -> None:
        """Stops the thread after it forwarded what the step loop queued; frees the ports."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for sock in (
            self._outbox_tx,
            self._outbox_rx,
            self._task_socket,
            self._event_socket,
            self._output_socket,
            *self._peer_sockets.values(),
        ):
            sock.close(linger=_CLOSE_LINGER_MS)
        self.context.term()

    # ---- the I/O thread ---------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._task_socket, zmq.POLLIN)
        poller.register(self._outbox_rx, zmq.POLLIN)
        while True:
            timeout_ms = max(1, int(self.heartbeat_interval_s * 1000 / 2))
            try:
                ready = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                return
            if self._task_socket in ready:
                self._receive_tasks()
            if self._outbox_rx in ready:
                self._forward_outbox()
            if self._stopping.is_set():
                self._forward_outbox()
                return
            now = time.monotonic()
            if now - self._last_sent >= self.heartbeat_interval_s or self._drops_due(now):
                self._send(self._encoder.encode(self._heartbeat()))
                self._close_idle_peers(now)

    def _drops_due(self, now: float) -> bool:
        """Dropped frames are reported within a heartbeat interval, busy or not."""
        if now - self._last_drop_report < self.heartbeat_interval_s or not DROPS.has_new():
            return False
        self._last_drop_report = now
        return True

    def _heartbeat(self) -> InstanceOutput:
        drops = [DroppedFrames(c, r, n) for (c, r), n in DROPS.take_new().items()]
        return InstanceOutput(
            instance=self.address,
            stats=self.latest_stats,
            metrics=MetricsDelta(dropped_frames=drops) if drops else None,
            epoch=self.epoch,
            loop_turns=self.loop_turns,
            unhealthy=self.unhealthy,
            sent_at=time.time(),
        )

    def _close_idle_peers(self, now: float) -> None:
        for address, used in list(self._peer_used.items()):
            if now - used >= PEER_IDLE_S:
                self._peer_sockets.pop(address).close(linger=_CLOSE_LINGER_MS)
                del self._peer_used[address]

    def _receive_tasks(self) -> None:
        while True:
            try:
                frame = self._task_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            opened = self._task_opener.open(frame, "a task socket peer")
            if opened is None:
                continue  # not from the deployment, or a replay: never decoded
            try:
                task = self._decoder.decode(opened.payload)
            except msgspec.DecodeError as exc:
                self._refuse_undecoded(opened.payload, opened.sender, exc)
                continue
            # A peer's message (a handoff) names no epoch of this instance: its own
            # sender's epoch is the role's to check.
            if isinstance(task, AddressedTask) and not self.epochs.admit(task.epoch):
                what = f"{type(task).__name__} for epoch {task.epoch}, {self.epochs.current} now"
                self._task_opener.refuse(frame_drops.STALE_EPOCH, f"{opened.sender} ({what})")
                continue
            self._tasks.append(Received(task, time.monotonic()))
        self._task_ready.set()

    def _refuse_undecoded(self, payload: bytes, sender: str, exc: Exception) -> None:
        """Counted stale if it is a task of the role this instance left, else malformed."""
        try:
            left = self._left.decode(payload) if self._left is not None else None
        except msgspec.DecodeError:
            left = None
        if left is not None:
            what = f"a {type(left).__name__} for the role it left"
            self._task_opener.refuse(frame_drops.STALE_EPOCH, f"{sender} ({what})")
            return
        self._task_opener.refuse(frame_drops.UNDECODABLE, sender)
        logger.warning("%s: dropping a malformed task: %s", self.address.instance_id, exc)

    def _forward_outbox(self) -> None:
        while True:
            try:
                kind, *frames = self._outbox_rx.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if kind == _KIND_OUTPUT:
                self._send(frames[0])
            elif kind == _KIND_PEER:
                self._send_to_peer(frames[0], frames[1])
            else:
                head = self._event_sealer.seal_parts(self._topic, frames[0])
                self._event_socket.send_multipart([self._topic, head, frames[0]])

    def _send_to_peer(self, task_address: bytes, payload: bytes) -> None:
        sock = self._peer_sockets.get(task_address)
        if sock is None:
            sock = self._peer_sockets[task_address] = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, _OUTPUT_HWM)
            sock.connect(task_address.decode())
        self._peer_used[task_address] = time.monotonic()
        try:
            sock.send(self._task_sealer.seal(payload), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning(
                "%s: peer %s is not reading; task dropped",
                self.address.instance_id,
                task_address.decode(),
            )

    def _send(self, payload: bytes) -> None:
        try:
            self._output_socket.send(self._output_sealer.seal(payload), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning(
                "%s: the gateway is not reading; output dropped", self.address.instance_id
            )
        self._last_sent = time.monotonic()
