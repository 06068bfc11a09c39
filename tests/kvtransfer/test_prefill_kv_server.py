"""The serving half with a transport whose sends complete when the test says so: a
decode side's `Done` may overtake this side's completion of the same sends; a hold
takes control messages from the one decode life it names, and drops (and counts)
those of any other."""

from __future__ import annotations

from pdserve.common.frame_drops import DROPS
from pdserve.kvtransfer.messages import Abort, BlockRun, Done, Heartbeat, HelloReply, HoldSpec, Pull
from tests.kvtransfer.manual_transport import LAYOUT, OTHER, PEER, hello, sent, serve


def test_done_before_the_sends_complete_still_counts_them_once() -> None:
    side, transport, server, stats, reports = serve()
    side.hold(HoldSpec("r", [2, 3, 5], "d", 0), now=0.0)
    side.on_message(PEER, hello(), now=0.0)
    assert isinstance(server.messages[-1][1], HelloReply) and not server.messages[-1][1].error
    side.on_message(PEER, sent(Pull("r", 7, 0, 2, [BlockRun(2, 2, 1), BlockRun(5, 1, 2)])), now=0.1)
    assert len(transport.sent) == 2 and stats.in_flight == 1
    side.on_message(PEER, sent(Done("r", 7, 0, 2)), now=0.2)  # the receiver finished first
    side.poll(now=0.2)
    assert reports == [] and stats.bytes_total == 0, "blocks stay held while sends run"
    for op in transport.sent:
        op.complete = True
    side.poll(now=0.3)
    assert reports == [("finished_sending", "r")]
    assert stats.bytes_total == 3 * LAYOUT.bytes_per_block
    assert (stats.transfers_total, stats.in_flight, stats.seconds_count) == (1, 0, 1)
    side.poll(now=0.4)
    assert reports == [("finished_sending", "r")] and side.num_held == 0


def test_an_abort_from_the_decode_side_abandons_its_sends_at_once() -> None:
    # This side was paused past the decode side's deadline: the pull and the Abort were
    # both queued. The pull's sends can never complete (their receives were cancelled);
    # the Abort says so, and the blocks go back without waiting for the lease.
    side, transport, _, stats, reports = serve(lease_s=30.0)
    side.hold(HoldSpec("r", [2, 3], "d", 0), now=0.0)
    side.hold(HoldSpec("other", [5], "d2", 0), now=0.0)
    side.on_message(PEER, hello(), now=0.0)
    side.on_message(PEER, sent(Pull("r", 7, 0, 2, [BlockRun(2, 2, 1)])), now=12.0)
    side.on_message(OTHER, hello("d2", b"addr2"), now=12.0)
    side.on_message(OTHER, sent(Pull("other", 8, 0, 2, [BlockRun(5, 1, 1)])), now=12.0)
    assert len(transport.sent) == 2 and stats.in_flight == 2
    side.on_message(PEER, sent(Abort("r", "timed out after 10s")), now=12.0)
    # Not d's to give up: "other" is held for d2, whose sends go on.
    side.on_message(PEER, sent(Abort("other", "not its pull")), now=12.0)
    side.poll(now=12.1)
    assert reports == [("aborted", "r")], "released on the Abort, not at the lease (30 s)"
    assert (stats.in_flight, stats.failures_total) == (1, 1)
    transport.sent[1].complete = True  # the other decode rank's sends end normally
    side.poll(now=12.2)
    assert reports == [("aborted", "r")] and side.num_held == 1
    side.on_message(OTHER, sent(Done("other", 8, 0, 2)), now=12.3)
    side.poll(now=12.4)
    assert reports == [("aborted", "r"), ("finished_sending", "other")] and side.num_held == 0


def stale_drops() -> int:
    return DROPS.totals().get(("kv_control", "stale_epoch"), 0)


def test_a_hold_hears_only_the_decode_life_it_names() -> None:
    # Held for decode instance d in epoch 3 (the gateway's routing); d in epoch 2 is a
    # life fenced since, that went on before it was killed.
    side, transport, server, _, reports = serve(epoch=5, lease_s=30.0)
    side.hold(HoldSpec("r", [2, 3], "d", 3), now=0.0)
    stale, before = b"d-fenced", stale_drops()
    side.on_message(stale, hello(info=b"old", epoch=2), now=0.0)
    side.on_message(PEER, hello(info=b"new", epoch=3), now=0.0)
    assert [m.error for _, m in server.messages] == ["", ""]
    side.on_message(stale, sent(Pull("r", 1, 0, 2, [BlockRun(2, 2, 1)]), 2), now=1.0)
    side.on_message(stale, sent(Abort("r", "its pull failed"), 2), now=1.0)
    side.on_message(stale, sent(Done("r", 1, 0, 2), 2), now=1.0)
    side.on_message(OTHER, sent(Abort("r", "a stranger to the hold"), 3), now=1.0)
    side.poll(now=1.1)
    assert transport.sent == [] and reports == [] and side.num_held == 1
    assert stale_drops() == before + 4
    # The life it names pulls and confirms; replies go out in this instance's epoch.
    side.on_message(PEER, sent(Pull("r", 7, 0, 2, [BlockRun(2, 2, 1)]), 3), now=2.0)
    assert len(transport.sent) == 1
    transport.sent[0].complete = True
    side.on_message(PEER, sent(Done("r", 7, 0, 2), 3), now=2.1)
    side.poll(now=2.2)
    assert reports == [("finished_sending", "r")] and stale_drops() == before + 4


def test_a_stale_lifes_heartbeats_renew_no_lease_and_its_pulls_get_no_reply() -> None:
    side, transport, server, _, reports = serve(
        lease_s=1.0, heartbeat_interval_s=0.2, transfer_timeout_s=0.5, handshake_timeout_s=0.5
    )
    side.hold(HoldSpec("r", [2], "d", 1), now=0.0)
    side.on_message(PEER, hello(), now=0.0)
    side.on_message(PEER, sent(Pull("r", 2, 0, 2, [BlockRun(2, 1, 1)]), 0), now=0.1)
    assert transport.sent == [] and len(server.messages) == 1  # the HelloReply only
    for now in (0.5, 0.9, 1.3):  # the previous epoch's heartbeats: the lease runs out
        side.on_message(PEER, sent(Heartbeat(["r"]), 0), now=now)
        side.poll(now=now)
    assert reports == [("expired", "r")]
