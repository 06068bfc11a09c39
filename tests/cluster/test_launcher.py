"""A launch still waiting gives up, in one line, when it is cancelled or its instances
are not ready in time; the names still loading come sorted, with the likely cause."""

from __future__ import annotations

import time

import pytest

from pdserve.cluster.launcher import LaunchError
from tests.cluster.processless import ProcesslessLauncher


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
