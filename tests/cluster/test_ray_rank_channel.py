"""The worker group's channel under Ray (cluster/ray_ranks.py), attacked from outside: a
frame that fails, a frame in another rank's name, a message of the wrong shape or size
is dropped and counted, and the group goes on with every rank's real reply."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

pytest.importorskip("ray")

from pdserve.cluster.ray_ranks import RayRankGroup, RayRanks, SealedChannel  # noqa: E402
from pdserve.common import frame_drops  # noqa: E402
from pdserve.common.frame_drops import DROPS  # noqa: E402
from pdserve.common.frame_seal import MAX_HEADER_BYTES, RANKS, Sealer  # noqa: E402


@pytest.fixture
def group() -> Iterator[RayRankGroup]:
    driver = RayRankGroup("127.0.0.1")
    driver.actors = ["rank 0", "rank 1"]  # stands in for two actors: only counted here
    yield driver
    driver.socket.close(linger=0)
    driver.context.term()


def dealer(context: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def drops_since(before: dict) -> dict:
    now = DROPS.totals()
    return {
        k: n - before.get(k, 0) for k, n in now.items() if k[0] == "ranks" and n != before.get(k, 0)
    }


def replies(group: RayRankGroup, waiting: set[int], timeout_s: float = 10.0) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout_s
    while waiting - set(got) and time.monotonic() < deadline:
        for rank, payload in group.receive(waiting - set(got)):
            assert rank not in got, f"a second reply of rank {rank} in one step"
            got[rank] = payload
    return got


def test_junk_in_any_name_leaves_the_step_whole(group) -> None:
    """Before any rank was heard: a bad frame as rank 99, a bad frame as rank 0 (its
    first), a three-part message, a frame of rank 1 replayed as rank 0's. The step still
    gets exactly rank 0's and rank 1's replies, and the next step no stale one."""
    context = zmq.Context()
    rank0, rank1 = dealer(context, group.address, b"0"), dealer(context, group.address, b"1")
    stranger = dealer(context, group.address, b"99")
    before = DROPS.totals()
    try:
        seal0, seal1 = Sealer(RANKS, "0"), Sealer(RANKS, "1")
        stranger.send(Sealer(RANKS, "99", secret=b"guess").seal(b"x"))
        shapeless = dealer(context, group.address, b"7")
        shapeless.send_multipart([b"a", b"b"])  # three parts with the identity
        rank0.send(Sealer(RANKS, "0", secret=b"guess").seal(b"forged first frame"))
        captured = seal1.seal(b"rank 1, step 1")
        rank0.send(captured)  # rank 1's frame under rank 0's identity
        rank1.send(captured)
        rank0.send(seal0.seal(b"rank 0, step 1"))
        assert replies(group, {0, 1}) == {0: b"rank 0, step 1", 1: b"rank 1, step 1"}
        rank1.send(captured)  # a replay on its own connection
        rank0.send(seal0.seal(b"rank 0, step 2"))
        rank1.send(seal1.seal(b"rank 1, step 2"))
        assert replies(group, {0, 1}) == {0: b"rank 0, step 2", 1: b"rank 1, step 2"}
        assert drops_since(before) == {
            ("ranks", frame_drops.IDENTITY): 2,  # rank 99 (no such rank), rank 1 as rank 0
            ("ranks", frame_drops.MALFORMED): 1,
            ("ranks", frame_drops.BAD_MAC): 1,
            ("ranks", frame_drops.REPLAY): 1,
        }
        shapeless.close()
    finally:
        for sock in (rank0, rank1, stranger):
            sock.close()
        context.term()


def test_a_malformed_message_is_dropped_not_raised(group) -> None:
    before = DROPS.totals()
    assert group.open([b"0", b"a", b"b"]) == []
    assert group.open([b"0"]) == []
    assert drops_since(before) == {("ranks", frame_drops.MALFORMED): 2}


def test_a_frame_past_the_limit_counts_as_oversized_whoever_sends_it(group) -> None:
    """A peer named like no rank is refused before its frame is opened, but a frame past
    the channel's limit is counted as what it is."""
    before = DROPS.totals()
    past_limit = bytes(RANKS.max_frame_bytes + MAX_HEADER_BYTES + 1)
    assert group.open([b"99", past_limit]) == []
    assert group.open([b"0", past_limit]) == []
    assert group.open([b"99", past_limit[:-1]]) == []  # at the limit: refused for its name
    assert drops_since(before) == {
        ("ranks", frame_drops.OVERSIZED): 2,
        ("ranks", frame_drops.IDENTITY): 1,
    }


def test_a_rank_whose_driver_has_another_secret_ends_naming_it() -> None:
    """A rank's DEALER hears only its driver: a frame that fails there is a secret
    mismatch, and the rank ends with a message saying so (the driver's watch reports it)."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    channel = SealedChannel(f"tcp://127.0.0.1:{port}", 0)
    try:
        channel.send_bytes(b"hello")
        identity, _ = router.recv_multipart()
        other = Sealer(RANKS, "driver", responder=True, secret=b"another deployment")
        router.send_multipart([identity, other.seal(b"load")])
        outcome: list[BaseException] = []
        thread = threading.Thread(target=lambda: _receive(channel, outcome))
        thread.start()
        thread.join(10)
        assert outcome and "fail the deployment secret check" in str(outcome[0])
    finally:
        channel.close()
        router.close(linger=0)
        context.term()


def _receive(channel: SealedChannel, outcome: list[BaseException]) -> None:
    try:
        channel.recv_bytes()
    except RuntimeError as exc:
        outcome.append(exc)


def test_a_one_stage_group_binds_loopback_a_spread_one_the_nodes_address() -> None:
    assert RayRanks("10.1.2.3", "decode-0").master_host() == "127.0.0.1"
    assert RayRanks("10.1.2.3", "decode-0", stages=2).master_host() == "10.1.2.3"
