"""The seal on every frame (common/frame_seal.py): bound to its sender, channel,
direction and sequence; checked for size before hashing; every drop counted."""

from __future__ import annotations

import logging

import pytest

from pdserve.common import frame_drops
from pdserve.common.frame_drops import FrameDrops
from pdserve.common.frame_seal import OUTPUTS, RANKS, TASKS, Channel, Sealer

SECRET = b"s3cret"


def ends(channel: Channel = TASKS, sender: str = "i-0") -> tuple[Sealer, Sealer, FrameDrops]:
    """A sending end and a receiving end of `channel`, the receiver counting in a book
    of its own."""
    book = FrameDrops()
    receiver = Sealer(channel, "rx", responder=True, secret=SECRET, name="rx", drops=book)
    return Sealer(channel, sender, secret=SECRET), receiver, book


def test_a_sealed_frame_opens_once_under_its_sender(caplog) -> None:
    tx, rx, book = ends()
    frame = tx.seal(b"payload")
    assert rx.open(frame) == ("i-0", b"payload")
    with caplog.at_level(logging.WARNING, logger="pdserve.common.frame_seal"):
        assert rx.open(frame, "tcp://10.0.0.9") is None  # the same frame again
    assert book.totals() == {("tasks", frame_drops.REPLAY): 1}
    assert "rx: dropped a tasks frame from tcp://10.0.0.9 (replay" in caplog.text
    later = tx.seal(b"next")
    assert rx.open(later) == ("i-0", b"next")
    assert rx.open(frame) is None  # older than what was heard: a replay too


def test_any_changed_byte_another_secret_or_no_seal_is_refused() -> None:
    tx, rx, book = ends()
    frame = tx.seal(b"payload")
    for at in (3, len(frame) - 10, len(frame) - 1):  # sender, tag, payload
        assert rx.open(frame[:at] + bytes([frame[at] ^ 1]) + frame[at + 1 :]) is None
    assert rx.open(Sealer(TASKS, "i-0", secret=b"other").seal(b"payload")) is None
    assert rx.open(b"payload") is None and rx.open(b"") is None
    totals = book.totals()
    assert totals[("tasks", frame_drops.BAD_MAC)] == 4
    assert totals[("tasks", frame_drops.MALFORMED)] == 2
    assert rx.open(frame) == ("i-0", b"payload")  # the untouched frame still opens


def test_a_frame_opens_on_no_other_channel_nor_in_the_other_direction() -> None:
    tx, _, _ = ends(TASKS)
    _, outputs, book = ends(OUTPUTS)
    assert outputs.open(tx.seal(b"task")) is None  # a task frame is no output
    driver = Sealer(RANKS, "driver", responder=True, secret=SECRET, drops=book)
    other_driver = Sealer(RANKS, "driver", responder=True, secret=SECRET, drops=book)
    assert other_driver.open(driver.seal(b"plan")) is None  # a driver's frame is no reply
    rank = Sealer(RANKS, "0", secret=SECRET)
    assert rank.open(driver.seal(b"plan"), sender="driver") == ("driver", b"plan")
    assert book.totals() == {
        ("outputs", frame_drops.BAD_MAC): 1,
        ("ranks", frame_drops.MALFORMED): 1,
    }


def test_a_frame_replays_under_no_other_name() -> None:
    """The sender's name is inside the MAC: naming another peer breaks it, and a
    receiver that knows its peer (a ROUTER's routing identity) asks for that name."""
    tx, rx, book = ends(RANKS, sender="1")
    frame = tx.seal(b"reply")
    assert rx.open(frame, sender="0") is None  # rank 1's frame arriving as rank 0's
    renamed = frame[:3] + b"0" + frame[4:]  # the header rewritten to name rank 0
    assert rx.open(renamed, sender="0") is None
    assert book.totals() == {
        ("ranks", frame_drops.IDENTITY): 1,
        ("ranks", frame_drops.BAD_MAC): 1,
    }
    assert rx.open(frame, sender="1") == ("1", b"reply")


def test_a_frame_over_its_channel_limit_is_never_hashed(monkeypatch) -> None:
    small = Channel("tiny", 64)
    tx, rx, book = ends(small)
    frame = tx.seal(b"x" * 200)

    def hashed(*args: object) -> bytes:
        raise AssertionError("an oversized frame was hashed")

    monkeypatch.setattr(rx, "_tag", hashed)
    assert rx.open(frame) is None
    assert rx.open_parts(frame[:60], b"y" * 100) is None
    assert book.totals() == {("tiny", frame_drops.OVERSIZED): 2}


def test_multipart_seals_bind_each_part_and_its_length() -> None:
    tx, rx, book = ends()
    head = tx.seal_parts(b"topic", b"body")
    assert rx.open_parts(head, b"topi", b"cbody") is None  # same bytes, other split
    assert rx.open_parts(head[:-1], b"topic", b"body") is None  # a cut header
    assert rx.open_parts(head, b"topic", b"body", sender="i-1") is None
    assert rx.open_parts(head, b"topic", b"body", sender="i-0") == "i-0"
    assert rx.open_parts(head, b"topic", b"body") is None  # once
    assert sum(book.totals().values()) == 4


def test_senders_of_one_name_in_two_processes_never_shadow_each_other() -> None:
    """Each end numbers its frames in a session of its own: a restarted sender (or two
    ends under one name) starts afresh without its frames taken for replays."""
    first, rx, book = ends()
    second = Sealer(TASKS, "i-0", secret=SECRET)
    frames = [first.seal(b"a"), second.seal(b"b"), first.seal(b"c"), second.seal(b"d")]
    assert [rx.open(f) for f in frames] == [("i-0", p) for p in (b"a", b"b", b"c", b"d")]
    assert book.totals() == {}


def test_a_sender_name_is_bounded() -> None:
    with pytest.raises(ValueError, match="at most 255 bytes"):
        Sealer(TASKS, "x" * 256, secret=SECRET)


def test_the_book_ships_each_drop_once() -> None:
    book = FrameDrops()
    book.count("tasks", "bad_mac")
    book.count("tasks", "bad_mac")
    assert book.has_new() and book.take_new() == {("tasks", "bad_mac"): 2}
    assert not book.has_new() and book.take_new() == {}
    book.count("events", "replay")
    assert book.take_new() == {("events", "replay"): 1}
    assert book.totals() == {("tasks", "bad_mac"): 2, ("events", "replay"): 1}
