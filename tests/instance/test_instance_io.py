"""An instance's I/O thread over real ZMQ sockets (no model): tasks in, outputs, heartbeats,
block events and peer messages out, ports freed on close."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from pdserve.common import frame_seal
from pdserve.common.frame_drops import DROPS
from pdserve.common.frame_seal import Channel, Sealer
from pdserve.common.messages import (
    AbortTask,
    GenerateTask,
    InstanceOutput,
    InstanceStats,
    RequestDelta,
    Task,
)
from pdserve.common.sampling_params import SamplingParams
from pdserve.instance.io import InstanceIO

ENCODER = msgspec.msgpack.Encoder()
OUTPUTS = msgspec.msgpack.Decoder(InstanceOutput)
# The gateway's ends and a peer's, under this process's secret (the instance's too).
SEAL = Sealer(frame_seal.TASKS, "gateway")
OUTPUT_OPEN = Sealer(frame_seal.OUTPUTS, "gateway", responder=True)
EVENT_OPEN = Sealer(frame_seal.EVENTS, "gateway", responder=True)
PEER_OPEN = Sealer(frame_seal.TASKS, "peer", responder=True)


class Ping(msgspec.Struct, tag="ping"):
    """A task type only a custom kind knows."""

    note: str


@pytest.fixture
def gateway() -> Iterator[tuple[zmq.Socket, str]]:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    yield pull, f"tcp://127.0.0.1:{port}"
    pull.close(linger=0)
    context.term()


@pytest.fixture
def io(gateway) -> Iterator[InstanceIO]:
    instance = InstanceIO("i-0", "colocated", gateway[1], heartbeat_interval_s=0.2,
                          task_type=Task | Ping)  # fmt: skip
    instance.start()
    yield instance
    instance.close()


def receive(pull: zmq.Socket, timeout_s: float = 5.0) -> InstanceOutput:
    assert pull.poll(int(timeout_s * 1000)), "nothing arrived"
    return OUTPUTS.decode(OUTPUT_OPEN.open(pull.recv()).payload)


def take(io: InstanceIO, count: int, timeout_s: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend(io.take_tasks(0.2))
    return got


def test_tasks_arrive_decoded_and_malformed_frames_are_dropped(io) -> None:
    context = zmq.Context.instance()
    push = context.socket(zmq.PUSH)
    push.connect(io.address.task_address)
    generate = GenerateTask("r1", [1, 2], SamplingParams(max_tokens=2, seed=3), arrival_time=0.0)
    sent = time.monotonic()
    push.send(SEAL.seal(ENCODER.encode(generate)))
    push.send(SEAL.seal(b"\x93not a task"))
    push.send(ENCODER.encode(AbortTask(["forged"])))  # no MAC: refused, never decoded
    push.send(SEAL.seal(ENCODER.encode(AbortTask(["r1"]))))
    push.send(SEAL.seal(ENCODER.encode(Ping("custom kinds decode their own task types"))))
    tasks = take(io, 3)
    push.close(linger=0)
    assert [r.task for r in tasks] == [
        generate, AbortTask(["r1"]), Ping("custom kinds decode their own task types")]  # fmt: skip
    # Each stamped as it was decoded: where a request's queue starts.
    stamps = [r.at for r in tasks]
    assert stamps == sorted(stamps) and sent <= stamps[0] <= time.monotonic()


def test_outputs_go_out_and_heartbeats_fill_the_silence(io, gateway) -> None:
    pull = gateway[0]
    stats = InstanceStats(num_running=1)
    io.send_output(InstanceOutput(io.address, [RequestDelta("r", [5], 0)], stats))
    first = receive(pull)
    assert first.deltas[0].new_token_ids == [5] and first.instance == io.address
    started = time.monotonic()
    beats = [receive(pull) for _ in range(3)]
    elapsed = time.monotonic() - started
    assert all(b.deltas == [] and b.stats == stats for b in beats)  # the latest stats
    assert 0.3 < elapsed < 3.0  # about one every 0.2 s


def test_block_events_carry_the_instance_as_topic_and_peers_get_tasks(io) -> None:
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(io.events_address)
    peer = context.socket(zmq.PULL)
    peer_port = peer.bind_to_random_port("tcp://127.0.0.1")
    time.sleep(0.3)  # PUB drops messages until the subscription is up
    io.publish_events(b"batch-bytes")
    io.send_to_peer(f"tcp://127.0.0.1:{peer_port}", ENCODER.encode(AbortTask(["x"])))
    assert sub.poll(5000)
    topic, tag, payload = sub.recv_multipart()
    assert (topic, payload) == (b"i-0", b"batch-bytes")
    assert EVENT_OPEN.open_parts(tag, topic, payload, sender="i-0") == "i-0"
    assert peer.poll(5000)
    assert msgspec.msgpack.decode(PEER_OPEN.open(peer.recv()).payload, type=Task) == AbortTask(
        ["x"]
    )
    sub.close(linger=0)
    peer.close(linger=0)


def test_close_frees_the_ports(gateway) -> None:
    instance = InstanceIO("i-1", "colocated", gateway[1])
    instance.start()
    ports = [int(a.rsplit(":", 1)[1]) for a in (instance.address.task_address,
                                                instance.events_address)]  # fmt: skip
    instance.close()
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))


def test_an_oversized_frame_is_never_buffered(gateway, monkeypatch) -> None:
    """A frame over the channel's limit is dropped before it is hashed (ZMQ drops a
    peer far over it before the frame is kept)."""
    monkeypatch.setattr("pdserve.instance.io.TASKS", Channel("tasks", 1024))
    instance = InstanceIO("i-2", "colocated", gateway[1], heartbeat_interval_s=0.2)
    instance.start()
    context = zmq.Context.instance()
    big, small = context.socket(zmq.PUSH), context.socket(zmq.PUSH)
    try:
        big.connect(instance.address.task_address)
        big.send(SEAL.seal(b"\x00" * 4096))
        small.connect(instance.address.task_address)
        small.send(SEAL.seal(ENCODER.encode(AbortTask(["fits"]))))
        assert [r.task for r in take(instance, 2, timeout_s=2.0)] == [AbortTask(["fits"])]
    finally:
        big.close(linger=0)
        small.close(linger=0)
        instance.close()


def test_a_peers_socket_is_closed_once_idle(gateway, monkeypatch) -> None:
    """One PUSH per decode address: a peer that left (restarts bring new ports) leaves
    none behind; a peer sent to again gets a fresh one."""
    monkeypatch.setattr("pdserve.instance.io.PEER_IDLE_S", 0.3)
    instance = InstanceIO("i-3", "prefill", gateway[1], heartbeat_interval_s=0.1)
    instance.start()
    peer = zmq.Context.instance().socket(zmq.PULL)
    address = f"tcp://127.0.0.1:{peer.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        instance.send_to_peer(address, ENCODER.encode(AbortTask(["a"])))
        assert peer.poll(5000) and PEER_OPEN.open(peer.recv()) is not None
        deadline = time.monotonic() + 5
        while instance._peer_sockets and time.monotonic() < deadline:
            time.sleep(0.05)
        assert instance._peer_sockets == {}
        instance.send_to_peer(address, ENCODER.encode(AbortTask(["b"])))
        assert peer.poll(5000)
        opened = PEER_OPEN.open(peer.recv())
        assert opened is not None and msgspec.msgpack.decode(
            opened.payload, type=Task
        ) == AbortTask(["b"])
    finally:
        peer.close(linger=0)
        instance.close()


def test_a_task_for_another_epoch_of_the_instance_is_dropped_and_counted(gateway) -> None:
    instance = InstanceIO("i-4", "colocated", gateway[1], task_type=Task | Ping, epoch=2)
    instance.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    before = DROPS.totals().get(("tasks", "stale_epoch"), 0)
    try:
        push.connect(instance.address.task_address)
        # Sent before a fence (epoch 1), to a successor of this process (3), to it (2).
        for epoch in (1, 3, 2):
            push.send(SEAL.seal(ENCODER.encode(AbortTask([f"e{epoch}"], epoch=epoch))))
        push.send(SEAL.seal(ENCODER.encode(Ping("a peer's message names no epoch of it"))))
        tasks = [r.task for r in take(instance, 2, timeout_s=2.0)]
        assert tasks == [AbortTask(["e2"], epoch=2), Ping("a peer's message names no epoch of it")]
        assert DROPS.totals()[("tasks", "stale_epoch")] == before + 2
    finally:
        push.close(linger=0)
        instance.close()


def test_a_late_message_for_the_role_it_left_counts_as_stale(gateway) -> None:
    instance = InstanceIO("i-5", "decode", gateway[1], task_type=Task | Ping)
    instance.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    before = DROPS.totals().get(("tasks", "stale_epoch"), 0)
    undecodable = DROPS.totals().get(("tasks", "undecodable"), 0)
    try:
        instance.change_role("prefill", Task)
        push.connect(instance.address.task_address)
        push.send(SEAL.seal(ENCODER.encode(Ping("a peer's message of the decode life"))))
        push.send(SEAL.seal(ENCODER.encode(AbortTask(["r1"]))))
        assert [r.task for r in take(instance, 1, timeout_s=2.0)] == [AbortTask(["r1"])]
        assert DROPS.totals()[("tasks", "stale_epoch")] == before + 1
        assert DROPS.totals().get(("tasks", "undecodable"), 0) == undecodable
    finally:
        push.close(linger=0)
        instance.close()
