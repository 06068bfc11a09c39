"""The gateway's end of its instances' sealed channels: tasks out, outputs and events in.

Each frame in is checked (`pdserve.common.frame_seal`) before it is decoded: too large,
malformed, replayed, sealed for another channel or under another instance's name than
the one it speaks for, it is dropped and counted in the gateway's own book
(`pdserve:dropped_frames_total`). A frame larger than `HASH_ON_LOOP_BYTES` is hashed on
a worker thread, so a flood of large junk never holds the event loop (and the
heartbeats it reads) while it is checked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from pdserve.common import frame_drops
from pdserve.common.block_events import BlockEventBatch
from pdserve.common.frame_drops import FrameDrops
from pdserve.common.frame_seal import EVENTS, OUTPUTS, TASKS, Sealer
from pdserve.common.messages import InstanceOutput, Task, decoded

HASH_ON_LOOP_BYTES = 64 << 10  # a larger frame is checked off the event loop


class InstanceFrames:
    def __init__(self, secret: bytes | None, drops: FrameDrops) -> None:
        """`secret`: the deployment's (None: from the environment); `drops`: the book
        the gateway's drops are counted in."""
        self._tasks = Sealer(TASKS, "gateway", secret=secret, drops=drops)
        self._outputs = Sealer(OUTPUTS, "gateway", responder=True, secret=secret, drops=drops)
        self._events = Sealer(EVENTS, "gateway", responder=True, secret=secret, drops=drops)
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(InstanceOutput)
        self._batch_decoder = msgspec.msgpack.Decoder(BlockEventBatch)

    def seal_task(self, task: Task) -> bytes:
        return self._tasks.seal(self._encoder.encode(task))

    async def open_output(self, frame: bytes) -> InstanceOutput | None:
        """The output in `frame`, sealed by the instance it names; None when dropped."""
        origin = "the output socket"
        opened = await _off_the_loop_if_large(len(frame), self._outputs.open, frame, origin)
        if opened is None:
            return None
        output = decoded(self._output_decoder, opened.payload, "instance output")
        if output is None:
            self._outputs.refuse(frame_drops.UNDECODABLE, opened.sender)
            return None
        if output.instance.instance_id != opened.sender or not _own_switch(output):
            self._outputs.refuse(frame_drops.IDENTITY, opened.sender)
            return None
        return output

    async def open_events(self, frames: list[bytes]) -> tuple[str, BlockEventBatch] | None:
        """(instance id, batch) of a [topic, seal, batch] message sealed by the instance
        its topic names; None when dropped."""
        if len(frames) != 3:
            self._events.refuse(frame_drops.MALFORMED, "the event socket")
            return None
        topic, head, payload = frames
        instance_id = topic.decode(errors="replace")
        origin = f"events of {instance_id!r}"
        check = self._events.open_parts
        sender = await _off_the_loop_if_large(
            len(payload), check, head, topic, payload, origin=origin, sender=instance_id
        )
        if sender is None:
            return None
        batch = decoded(self._batch_decoder, payload, "block-event batch")
        if batch is None:
            self._events.refuse(frame_drops.UNDECODABLE, origin)
            return None
        return instance_id, batch


async def _off_the_loop_if_large(size: int, check: Any, *args: Any, **kwargs: Any) -> Any:
    if size <= HASH_ON_LOOP_BYTES:
        return check(*args, **kwargs)
    return await asyncio.to_thread(check, *args, **kwargs)


def _own_switch(output: InstanceOutput) -> bool:
    """A role switch an output announces is its sender's own, in the output's (new)
    epoch: another holder of the secret must not move an instance between pools."""
    switched = output.switched
    if switched is None:
        return True
    return (switched.address.instance_id, switched.epoch) == (
        output.instance.instance_id,
        output.epoch,
    )
