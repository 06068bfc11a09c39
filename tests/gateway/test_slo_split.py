"""The closed-form split scores: a mix of prompt lengths costs what each band costs."""

from __future__ import annotations

import pytest

from pdserve.gateway.slo_split import SplitScorer
from pdserve.gateway.slo_types import Forecast, LoadClass, Observation, PoolObservation
from tests.gateway.test_slo_policy import CALIBRATION, config

IDLE = Observation(
    at=0.0,
    interval_s=2.0,
    prefill=PoolObservation(4, 0, 0, 0, 0.0),
    decode=PoolObservation(4, 0, 0, 0, 0.0),
    ttft_ms=(),
    itl_ms=(),
    arrivals=(),
    operator_change=False,
)


def test_a_mix_of_bands_costs_the_prefill_pool_what_each_band_costs() -> None:
    scorer = SplitScorer(config(), CALIBRATION)
    chat = LoadClass(rate=6.0, prompt_tokens=200.0, output_tokens=450.0, prompt_tokens_sq=4e4)
    rag = LoadClass(rate=2.0, prompt_tokens=2000.0, output_tokens=40.0, prompt_tokens_sq=4e6)
    mean = (6.0 * 200.0 + 2.0 * 2000.0) / 8.0
    square = (6.0 * 4e4 + 2.0 * 4e6) / 8.0
    banded = Forecast(8.0, mean, 346.25, square, classes=(chat, rag))
    single = Forecast(8.0, mean, 346.25, square)
    ttft_banded, _ = scorer.predict_ttft(4, banded, IDLE)
    ttft_single, _ = scorer.predict_ttft(4, single, IDLE)
    # A 2000-token prompt fills a step alone; 650 tokens' worth of prompts share one.
    assert ttft_banded > ttft_single
    assert ttft_banded >= scorer.prompt_seconds(2000.0)
    # Decode: the same output tokens per second either way, the context token-weighted.
    itl_banded, _ = scorer.predict_itl(4, banded, IDLE)
    assert itl_banded == pytest.approx(scorer.predict_itl(4, single, IDLE)[0], rel=0.05)


def test_one_band_is_the_totals() -> None:
    load = Forecast(3.0, 500.0, 100.0)
    assert load.by_class() == (LoadClass(3.0, 500.0, 100.0, 500.0**2),)
