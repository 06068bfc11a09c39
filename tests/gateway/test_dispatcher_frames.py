"""The dispatcher's sockets under junk (gateway/dispatcher.py): outputs sealed under
another instance's name, replayed, oversized or shapeless, and event messages of the
wrong shape are dropped before they are decoded, each counted in
`pdserve:dropped_frames_total{channel,reason}` with what instances report; the
instance is heard throughout and never fenced, and its tokens arrive once."""

from __future__ import annotations

import asyncio
import re

import msgspec
import zmq

from pdserve.common.frame_seal import MAX_HEADER_BYTES, OUTPUTS, Sealer
from pdserve.common.messages import (
    DroppedFrames,
    GenerateTask,
    InstanceAddress,
    InstanceOutput,
    MetricsDelta,
    RequestDelta,
)
from pdserve.gateway.dispatcher import Dispatcher
from pdserve.gateway.instance_frames import HASH_ON_LOOP_BYTES
from pdserve.gateway.request_stream import StreamEvent
from tests.gateway.test_dispatcher_liveness import ScriptedInstance, run, task, until


def dropped(dispatcher: Dispatcher) -> dict[tuple[str, str], float]:
    text = dispatcher.metrics.render().decode()
    found = re.findall(
        r'^pdserve:dropped_frames_total{channel="(\w+)",reason="(\w+)"} (\S+)$', text, re.M
    )
    return {(c, r): float(n) for c, r, n in found}


def test_junk_on_the_output_and_event_sockets_is_dropped_and_counted() -> None:
    run(under_attack)


async def under_attack(dispatcher: Dispatcher, context: zmq.Context) -> None:
    d0 = ScriptedInstance(context, "d0", "colocated", dispatcher.output_address)
    attacker = context.socket(zmq.PUSH)
    attacker.connect(dispatcher.output_address)
    events_in = context.socket(zmq.PUB)  # what the gateway's SUB hears: frames of any shape
    events_port = events_in.bind_to_random_port("tcp://127.0.0.1")
    dispatcher._event_socket.connect(f"tcp://127.0.0.1:{events_port}")
    try:
        dispatcher.register(d0.info)
        d0.say()
        heard: list[StreamEvent] = []
        dispatcher.submit(task("r1"), heard.append)
        assert (await d0.next_task(GenerateTask)).request_id == "r1"

        # Another holder of the secret speaking for d0; d0's own frame replayed.
        impostor = Sealer(OUTPUTS, "d1")
        forged = InstanceOutput(d0.address, [RequestDelta("r1", [66], 0)], epoch=0)
        attacker.send(impostor.seal(msgspec.msgpack.encode(forged)))
        real = d0.seal.seal(msgspec.msgpack.encode(InstanceOutput(
            d0.address, [RequestDelta("r1", [7], 0)], epoch=0)))  # fmt: skip
        d0.outputs.send(real)
        attacker.send(real)
        # Large junk (checked off the loop) and a large real output (opened off it too).
        stranger = Sealer(OUTPUTS, "d0", secret=b"a guess")
        attacker.send(stranger.seal(b"\x00" * (4 * HASH_ON_LOOP_BYTES)))
        long_delta = RequestDelta("r1", list(range(8, 8 + HASH_ON_LOOP_BYTES // 2)), 1)
        d0.outputs.send(d0.seal.seal(msgspec.msgpack.encode(
            InstanceOutput(d0.address, [long_delta], epoch=0))))  # fmt: skip
        attacker.send_multipart([b"one", b"two", b"three"])  # each part a shapeless frame
        over = OUTPUTS.max_frame_bytes + MAX_HEADER_BYTES + 1
        attacker.send(b"x" * over)  # over the limit: dropped before it is hashed
        await asyncio.sleep(0.3)  # the SUB's connection is up
        events_in.send_multipart([b"d0", b"no header"])
        # An instance reports what its own sockets dropped.
        report = MetricsDelta(dropped_frames=[DroppedFrames("tasks", "bad_mac", 3)])
        d0.outputs.send(d0.seal.seal(msgspec.msgpack.encode(
            InstanceOutput(d0.address, metrics=report, epoch=0))))  # fmt: skip

        expected = {
            ("outputs", "identity"): 1.0,
            ("outputs", "replay"): 1.0,
            ("outputs", "bad_mac"): 1.0,
            ("outputs", "malformed"): 3.0,
            ("outputs", "oversized"): 1.0,
            ("events", "malformed"): 1.0,
            ("tasks", "bad_mac"): 3.0,
        }
        await until(lambda: dropped(dispatcher) == expected, 10, "every drop counted",
                    keep_alive=[d0])  # fmt: skip
        tokens = [t for e in heard if e.delta for t in e.delta.new_token_ids]
        assert tokens == [7, *long_delta.new_token_ids]  # d0's, each once; none forged
        assert dispatcher.scheduler.views["d0"].alive
        assert dispatcher.metrics.fenced.labels("colocated", "d0")._value.get() == 0
    finally:
        d0.close()
        attacker.close(linger=0)
        events_in.close(linger=0)


def test_an_instance_cannot_announce_another_ones_role_switch() -> None:
    run(switch_of_another)


async def switch_of_another(dispatcher: Dispatcher, context: zmq.Context) -> None:
    d0 = ScriptedInstance(context, "d0", "decode", dispatcher.output_address)
    d1 = ScriptedInstance(context, "d1", "decode", dispatcher.output_address)
    try:
        dispatcher.register(d0.info)
        dispatcher.register(d1.info)
        moved = msgspec.structs.replace(
            d0.info, address=InstanceAddress("d0", "prefill", d0.address.task_address), epoch=1
        )
        # d1 holds the secret and seals as itself, but names d0's switch.
        claim = InstanceOutput(d1.address, epoch=1, switched=moved)
        d1.outputs.send(d1.seal.seal(msgspec.msgpack.encode(claim)))
        await until(lambda: dropped(dispatcher).get(("outputs", "identity")) == 1.0, 10,
                    "the claim dropped", keep_alive=[d0, d1])  # fmt: skip
        view = dispatcher.scheduler.views["d0"]
        assert (view.role, view.epoch) == ("decode", 0)
    finally:
        d0.close()
        d1.close()
