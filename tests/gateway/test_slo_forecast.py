"""The load forecast: smoothing over time, bursts at once, empty intervals keep the means."""

from __future__ import annotations

import pytest

from pdserve.gateway.slo_forecast import LoadForecaster
from pdserve.gateway.slo_types import Arrival

SHORT, LONG = Arrival(100, 400), Arrival(2000, 40)


def test_a_steady_load_is_its_own_forecast() -> None:
    forecaster = LoadForecaster(halflife_s=10.0)
    for _ in range(5):
        forecaster.observe([SHORT] * 10, 2.0)
    load = forecaster.forecast()
    assert load.rate == pytest.approx(5.0)
    assert (load.prompt_tokens, load.output_tokens) == pytest.approx((100.0, 400.0))
    assert load.prompt_tokens_sq == pytest.approx(100.0**2)


def test_empty_intervals_lower_the_rate_but_keep_the_lengths() -> None:
    forecaster = LoadForecaster(halflife_s=10.0)
    forecaster.observe([LONG] * 4, 2.0)
    for _ in range(5):
        forecaster.observe([], 2.0)
    load = forecaster.forecast()
    assert load.rate == pytest.approx(2.0 * 0.5)  # 10 s: one half-life
    assert (load.prompt_tokens, load.output_tokens) == pytest.approx((2000.0, 40.0))


def test_a_burst_counts_at_once_and_noise_does_not() -> None:
    forecaster = LoadForecaster(halflife_s=30.0)
    for _ in range(10):
        forecaster.observe([SHORT] * 10, 1.0)
    forecaster.observe([SHORT] * 14, 1.0)  # a little over ten: Poisson noise
    assert forecaster.forecast().rate == pytest.approx(10.0, abs=0.5)
    forecaster.observe([SHORT] * 40, 1.0)
    assert forecaster.forecast().rate == pytest.approx(40.0)


def test_the_mix_shows_in_the_second_moment() -> None:
    forecaster = LoadForecaster(halflife_s=10.0)
    forecaster.observe([SHORT, LONG] * 5, 2.0)
    load = forecaster.forecast()
    assert load.prompt_tokens == pytest.approx(1050.0)
    assert load.prompt_tokens_sq == pytest.approx((100.0**2 + 2000.0**2) / 2)
    with pytest.raises(ValueError, match="positive"):
        forecaster.observe([], 0.0)
