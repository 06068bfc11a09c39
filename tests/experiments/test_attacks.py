"""The attack suite's messages past a channel's limit (`experiments/attacks.py`): one
byte past it as the channel's receiver measures, smallest first, one message for
channels alike."""

from __future__ import annotations

from experiments import attacks
from pdserve.common.frame_seal import KV_CONTROL, OUTPUTS, RANKS, TASKS, Sealer
from pdserve.kvtransfer.zmq_transport import KV_DATA


def test_each_message_is_one_byte_past_its_channels_limit() -> None:
    for channel in (TASKS, OUTPUTS, RANKS, KV_CONTROL):
        [frame] = attacks.oversized_message(channel)
        opener = Sealer(channel, "receiver", responder=True, secret=b"s")
        assert opener.too_large(len(frame)) and not opener.too_large(len(frame) - 1)
    seal, header, chunk = attacks.oversized_message(KV_DATA)
    assert len(header) + len(chunk) == KV_DATA.max_frame_bytes + 1  # what a chunk's seal covers


def test_a_socket_gets_the_smallest_first_and_alike_channels_once() -> None:
    pulls = attacks.oversized_messages(attacks.RECEIVERS["zmq PULL"])
    assert list(pulls) == ["kv_data limit + 1 byte", "tasks/outputs limit + 1 byte"]
    routers = attacks.oversized_messages(attacks.RECEIVERS["zmq ROUTER"])
    assert list(routers) == ["kv_control limit + 1 byte", "ranks limit + 1 byte"]
