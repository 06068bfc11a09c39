"""The instance's test hooks: the pull delay comes only with them, read from the
environment; a LeakBlocksTask is refused without them (tests/cluster checks the leak)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.instance.hooks import TEST_DELAY_ENV, DelayedPulls, TestHooks, injected_delay_s


def test_delayed_pulls_come_due_in_order_and_can_be_dropped() -> None:
    pulls = DelayedPulls(delay_s=2.0)
    for name, at in (("a", 0.0), ("b", 1.0), ("c", 1.5)):
        pulls.add(SimpleNamespace(request_id=name), now=at)
    pulls.drop("b")
    assert pulls.pop_due(now=1.9) == []
    assert [a.request_id for a in pulls.pop_due(now=3.6)] == ["a", "c"]
    assert len(pulls) == 0
    at_once = DelayedPulls(0.0)
    at_once.add(SimpleNamespace(request_id="x"), now=5.0)
    assert [a.request_id for a in at_once.pop_due(now=5.0)] == ["x"]


def test_the_test_only_delay_is_read_from_the_environment() -> None:
    assert injected_delay_s({}) == 0.0
    assert injected_delay_s({TEST_DELAY_ENV: "2.5"}) == 2.5
    for bad in ("soon", "-1"):
        with pytest.raises(ValueError, match=TEST_DELAY_ENV):
            injected_delay_s({TEST_DELAY_ENV: bad})


def test_hooks_hold_pulls_back_only_when_a_delay_is_set() -> None:
    assert TestHooks({}).delayed_pulls() is None
    delayed = TestHooks({TEST_DELAY_ENV: "1.5"}).delayed_pulls()
    assert delayed is not None and delayed.delay_s == 1.5
