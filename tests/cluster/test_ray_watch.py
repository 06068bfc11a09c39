"""The Ray launcher's actors after the launch (`cluster/ray_watch.py`) on the session's Ray
cluster, without a model: an actor no node has room for (a custom resource nobody has,
as after a node loss with the pools full) does not block its start, is said once to
wait, and is stopped at once; its end reaches the exit callback."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from pdserve.cluster import ray_watch
from pdserve.common.wire_auth import SECRET_ENV
from pdserve.instance.spec import InstanceSpec

pytestmark = pytest.mark.slow


def test_an_actor_no_node_can_take_waits_without_blocking_and_stops_at_once(
    ray_cluster, monkeypatch, caplog
) -> None:
    from pdserve.cluster.ray_launcher import RayLauncher

    monkeypatch.setattr(ray_watch, "PLACEMENT_NOTE_S", 0.5)
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)  # what the actor would get; not left behind
    launcher = RayLauncher(
        address=ray_cluster, num_cpus={"decode-0": 0.1}, resources={"decode": {"nowhere": 1.0}}
    )
    launcher.connect()  # the session's connection
    exits: list[tuple[str, str]] = []
    exited = threading.Event()
    launcher.watch(lambda i, why: (exits.append((i, why)), exited.set()))
    spec = InstanceSpec(instance_id="decode-77", role="decode", gateway_address="tcp://x:1")
    try:
        with caplog.at_level(logging.WARNING, logger=ray_watch.__name__):
            started = time.monotonic()
            assert launcher.start_instance(spec, lambda info: pytest.fail("it cannot load"))
            assert time.monotonic() - started < 1.0  # the caller never waits for Ray
            deadline = time.monotonic() + 20
            while "waiting for a node with room" not in caplog.text:
                assert time.monotonic() < deadline, "no word of the actor that waits"
                time.sleep(0.1)
            time.sleep(1.5)  # said once, not every turn of the watch
            assert caplog.text.count("waiting for a node with room") == 1
            assert exits == []
        assert launcher.num_cpus["decode-77"] == 0.1  # what its pool's first one asks
        assert launcher.stop_instance("decode-77")  # still loading: killed at once
        assert exited.wait(20), "its end was not reported"
        assert exits[0][0] == "decode-77" and "failed to load" in exits[0][1]
    finally:
        launcher.stopping.set()
        launcher.actor_watch.join()
