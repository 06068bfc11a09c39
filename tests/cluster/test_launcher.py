"""A launch still waiting gives up, in one line, when it is cancelled or its instances
are not ready in time; the names still loading come sorted, with the likely cause. Its
loading hands each instance on as it is ready, with a progress line."""

from __future__ import annotations

import time

import pytest

from pdserve.cluster.launcher import LaunchError
from pdserve.common.messages import InstanceInfo
from tests.cluster.processless import ProcesslessLauncher
from tests.gateway.instances import instance_info


def test_a_launch_within_its_time_goes_on() -> None:
    ProcesslessLauncher().check_loading(time.monotonic() + 60, ["decode-0"])


def test_a_cancelled_launch_gives_up() -> None:
    launcher = ProcesslessLauncher()
    launcher.cancel()
    with pytest.raises(LaunchError, match="^cancelled while instances were loading$"):
        launcher.check_loading(time.monotonic() + 60, ["decode-0"])


def test_a_launch_past_its_deadline_names_what_still_loads() -> None:
    launcher = ProcesslessLauncher(ready_timeout_s=2.5)
    with pytest.raises(LaunchError) as raised:
        launcher.check_loading(time.monotonic() - 1, {"prefill-0", "decode-0"}, " (why?)")
    assert str(raised.value) == "instances not ready after 2.5 s: ['decode-0', 'prefill-0'] (why?)"


def test_a_launch_s_loading_hands_each_ready_instance_on_and_keeps_its_deadline(
    capsys,
) -> None:
    launcher = ProcesslessLauncher(ready_timeout_s=0.2)
    loading = launcher.loading(2)
    loading.check(["prefill-0", "decode-0"])  # within its time
    info = instance_info("decode-0", "decode")
    handed: list[InstanceInfo] = []
    loading.ready("decode-0", info, handed.append)
    assert handed == [info]
    assert "pdserve: 1/2 instances ready" in capsys.readouterr().err
    time.sleep(0.3)
    with pytest.raises(LaunchError, match=r"not ready after 0.2 s: \['prefill-0'\]$"):
        loading.check(["prefill-0"])
