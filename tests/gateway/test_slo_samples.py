"""The SLO controller's samples stay bounded: a uniform sample of the interval's gaps and
TTFTs, every arrival up to a cap (past it counted), and each `take` starts anew."""

from __future__ import annotations

from pdserve.gateway import slo_samples
from pdserve.gateway.slo_samples import ITL_SAMPLES, SloSamples


def test_gaps_are_a_bounded_uniform_sample_taken_once() -> None:
    samples = SloSamples()
    for n in range(10 * ITL_SAMPLES):
        samples.add_gap(n / 1000.0)  # n ms
    _, gaps, _ = samples.take()
    assert len(gaps) == ITL_SAMPLES
    late = sum(1 for g in gaps if g >= 5 * ITL_SAMPLES)  # the second half of the interval
    assert 0.4 * ITL_SAMPLES < late < 0.6 * ITL_SAMPLES  # not only the first, nor the last
    assert samples.take() == ((), (), ())


def test_arrivals_are_kept_whole_up_to_the_cap(monkeypatch) -> None:
    monkeypatch.setattr(slo_samples, "MAX_ARRIVALS", 3)
    samples = SloSamples()
    samples.add_ttft(0.5)
    for tokens in range(5):
        samples.add_arrival(tokens, 16)
    assert samples.arrivals_dropped == 2
    ttft, _, arrivals = samples.take()
    assert ttft == (500.0,) and [a.prompt_tokens for a in arrivals] == [0, 1, 2]
    assert samples.arrivals_dropped == 0
