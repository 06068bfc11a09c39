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
    for _ in range(40):
        forecaster.observe([LONG] * 4, 2.0)
    for _ in range(5):
        forecaster.observe([], 2.0)
    load = forecaster.forecast()
    assert load.rate == pytest.approx(2.0 * 0.5, rel=0.01)  # 10 s: one half-life
    assert (load.prompt_tokens, load.output_tokens) == pytest.approx((2000.0, 40.0))


def test_the_first_intervals_are_a_mean_not_the_first_one_smoothed() -> None:
    # Three requests in the first second, none in the next four: about 0.6 a second,
    # where taking the first second as the level would still say 2.7 after four more.
    forecaster = LoadForecaster(halflife_s=30.0)
    forecaster.observe([SHORT] * 3, 1.0)
    for _ in range(4):
        forecaster.observe([], 1.0)
    assert forecaster.forecast().rate == pytest.approx(0.6, rel=0.05)
    assert forecaster.arrivals == 3


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


def test_each_band_of_prompt_lengths_is_its_own_class() -> None:
    forecaster = LoadForecaster(halflife_s=10.0)
    forecaster.observe([SHORT] * 6 + [LONG] * 2, 2.0)
    classes = forecaster.forecast().classes
    assert [(c.rate, c.prompt_tokens, c.output_tokens) for c in classes] == [
        pytest.approx((3.0, 100.0, 400.0)),
        pytest.approx((1.0, 2000.0, 40.0)),
    ]
    # A band first seen later starts from nothing: one long prompt is not one a second.
    forecaster = LoadForecaster(halflife_s=10.0)
    forecaster.observe([SHORT] * 10, 1.0)
    forecaster.observe([SHORT] * 10 + [LONG], 1.0)
    long_class = forecaster.forecast().classes[-1]
    assert long_class.prompt_tokens == pytest.approx(2000.0)
    assert long_class.rate == pytest.approx(1.0 - 0.5**0.1)


def test_a_band_rising_from_nothing_takes_its_level_in_two_intervals() -> None:
    forecaster = LoadForecaster(halflife_s=30.0)
    for _ in range(10):
        forecaster.observe([SHORT] * 10, 1.0)
    forecaster.observe([SHORT] * 10 + [LONG] * 6, 1.0)  # a burst: counted at once
    assert forecaster.forecast().classes[-1].rate == pytest.approx(6.0)
    forecaster.observe([SHORT] * 10 + [LONG] * 8, 1.0)  # again: the level moved
    forecaster.observe([SHORT] * 10 + [LONG] * 7, 1.0)
    # Smoothing alone would still say under one a second after three intervals.
    assert forecaster.forecast().classes[-1].rate == pytest.approx(7.0, abs=0.1)


def test_a_band_that_stops_is_gone_in_two_intervals_and_one_lull_is_noise() -> None:
    forecaster = LoadForecaster(halflife_s=30.0)
    for _ in range(100):  # past the first intervals' mean: smoothed
        forecaster.observe([SHORT] * 20 + [LONG] * 2, 1.0)
    forecaster.observe([LONG] * 2, 1.0)  # one lull off the noise, then the usual again
    forecaster.observe([SHORT] * 20 + [LONG] * 2, 1.0)
    assert forecaster.forecast().classes[0].rate > 19.0  # smoothed, not a new level
    forecaster.observe([LONG] * 2, 1.0)
    forecaster.observe([LONG] * 2, 1.0)
    load = forecaster.forecast()
    assert [c.prompt_tokens for c in load.classes] == [pytest.approx(2000.0)]
    assert load.rate == pytest.approx(2.0)
