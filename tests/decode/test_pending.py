"""The decode kind's small books: voided handoffs, delayed pulls, the test-only delay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.decode.pending import TEST_DELAY_ENV, DelayedPulls, VoidedHandoffs, injected_delay_s


def test_a_voided_handoff_is_dropped_once_and_only_from_its_prefill_instance() -> None:
    voided = VoidedHandoffs(ttl_s=10.0)
    voided.add("r", "prefill-0", now=0.0)
    assert not voided.consume("r", "prefill-1", now=1.0)  # a retry elsewhere goes through
    assert voided.consume("r", "prefill-0", now=1.0)
    assert not voided.consume("r", "prefill-0", now=1.0)  # once


def test_voided_entries_age_out_and_stay_bounded() -> None:
    voided = VoidedHandoffs(ttl_s=10.0, limit=3)
    voided.add("old", "p", now=0.0)
    voided.add("a", "p", now=20.0)  # "old" expired: pruned
    assert len(voided) == 1 and not voided.consume("old", "p", now=20.0)
    for name in "bcd":
        voided.add(name, "p", now=21.0)
    assert len(voided) == 3 and not voided.consume("a", "p", now=21.0)  # the oldest went
    assert not voided.consume("d", "p", now=40.0)  # expired


def test_delayed_pulls_come_due_in_order_and_can_be_dropped() -> None:
    pulls = DelayedPulls(delay_s=2.0)
    for name, at in (("a", 0.0), ("b", 1.0), ("c", 1.5)):
        pulls.add(SimpleNamespace(request_id=name), now=at)
    pulls.drop("b")
    assert pulls.pop_due(now=1.9) == []
    assert [a.request_id for a in pulls.pop_due(now=3.6)] == ["a", "c"]
    assert len(pulls) == 0
    at_once = DelayedPulls()
    at_once.add(SimpleNamespace(request_id="x"), now=5.0)
    assert [a.request_id for a in at_once.pop_due(now=5.0)] == ["x"]


def test_the_test_only_delay_is_read_from_the_environment() -> None:
    assert injected_delay_s({}) == 0.0
    assert injected_delay_s({TEST_DELAY_ENV: "2.5"}) == 2.5
    for bad in ("soon", "-1"):
        with pytest.raises(ValueError, match=TEST_DELAY_ENV):
            injected_delay_s({TEST_DELAY_ENV: bad})
