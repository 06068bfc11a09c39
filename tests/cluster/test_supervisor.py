"""The supervisor's decisions without processes: a dead instance restarts at once in the
epoch the gateway retired it into, one that keeps dying waits longer each time, none
restarts while the launcher stops; a fenced instance is killed (its exit then restarts
it); the gateway's books refuse a replacement that would
speak in a retired epoch."""

from __future__ import annotations

import threading

import msgspec
import pytest

from pdserve.cluster.supervisor import MAX_DELAY_S, STABLE_S, Supervisor
from pdserve.gateway.global_scheduler import GlobalScheduler
from pdserve.instance.spec import InstanceSpec
from tests.cluster.processless import ProcesslessLauncher
from tests.gateway.instances import instance_info


class RecordingLauncher(ProcesslessLauncher):
    def __init__(self) -> None:
        super().__init__()
        self.restarted: list[InstanceSpec] = []
        self.killed: list[str] = []
        self.done = threading.Event()

    def start_instance(self, spec, on_ready) -> bool:
        self.restarted.append(spec)
        self.done.set()
        return True

    def kill_instance(self, instance_id) -> bool:
        self.killed.append(instance_id)
        return True


SPEC = InstanceSpec(instance_id="decode-0", role="decode", gateway_address="tcp://g:1")


def test_a_dead_instance_restarts_at_once_in_its_next_epoch() -> None:
    launcher = RecordingLauncher()
    supervisor = Supervisor(launcher, [SPEC], on_ready=lambda info: None)
    supervisor.instance_exited("decode-0", epoch=3)
    assert launcher.done.wait(5)
    assert launcher.restarted == [msgspec.structs.replace(SPEC, epoch=3)]
    supervisor.instance_exited("unknown-7", epoch=1)  # not planned: nothing to start
    launcher.shutdown()
    supervisor.instance_exited("decode-0", epoch=4)  # stopping: never again
    supervisor.close()
    assert len(launcher.restarted) == 1


def test_a_fenced_instance_is_killed_not_restarted_until_it_exits() -> None:
    launcher = RecordingLauncher()
    supervisor = Supervisor(launcher, [SPEC], on_ready=lambda info: None)
    supervisor.fence("decode-0")
    assert launcher.killed == ["decode-0"] and launcher.restarted == []
    launcher.shutdown()
    supervisor.fence("decode-0")  # stopping: the shutdown stops it anyway
    assert launcher.killed == ["decode-0"]


def test_an_instance_that_keeps_dying_waits_longer_each_time() -> None:
    now = [0.0]
    supervisor = Supervisor(RecordingLauncher(), [SPEC], lambda info: None, clock=lambda: now[0])
    delays = []
    for _ in range(9):
        delays.append(supervisor.delay_s("decode-0"))
        now[0] += delays[-1] + 1.0  # it dies a second after each restart
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, MAX_DELAY_S, MAX_DELAY_S]
    now[0] += STABLE_S + 1  # then it ran for a while: the next death restarts at once
    assert supervisor.delay_s("decode-0") == 0.0


def test_a_replacement_starts_past_every_retired_epoch() -> None:
    gs = GlobalScheduler()
    gs.add_instance(instance_info("d0", "decode"), now=0.0)
    gs.mark_dead("d0")  # epoch 0 retired: its successor speaks in 1
    with pytest.raises(ValueError, match="already retired"):
        gs.add_instance(instance_info("d0", "decode"), now=1.0)
    restarted = msgspec.structs.replace(instance_info("d0", "decode"), epoch=1)
    view = gs.add_instance(restarted, now=1.0)
    assert view.alive and view.epoch == 1
    assert not gs.observe("d0", None, 2.0, epoch=0) and gs.observe("d0", None, 2.0, epoch=1)
