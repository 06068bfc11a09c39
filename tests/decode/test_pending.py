"""The decode role's book of handoffs voided before they arrived."""

from __future__ import annotations

from pdserve.decode.pending import VoidedHandoffs


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
