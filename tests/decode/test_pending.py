"""The decode role's books of late handoffs: voided before they arrived, or from a
retired epoch of their prefill instance."""

from __future__ import annotations

from pdserve.common.frame_drops import DROPS, STALE_EPOCH
from pdserve.decode.pending import SourceEpochs, VoidedHandoffs


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


def test_a_handoff_from_a_retired_epoch_is_dropped_and_counted() -> None:
    epochs = SourceEpochs(limit=2)
    before = DROPS.totals().get(("tasks", STALE_EPOCH), 0)
    assert epochs.admit("prefill-0", 0)
    assert epochs.admit("prefill-0", 1)  # its replacement
    assert not epochs.admit("prefill-0", 0)  # the fenced one, still talking
    assert epochs.admit("prefill-0", 1) and epochs.admit("prefill-1", 0)
    assert DROPS.totals()[("tasks", STALE_EPOCH)] == before + 1
    epochs.admit("prefill-2", 0)  # bounded: the longest silent source is forgotten
    assert epochs.admit("prefill-0", 0)
