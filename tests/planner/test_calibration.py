"""Calibration through the public `pdserve` API."""

from __future__ import annotations

import sys
import types

import pytest

import pdserve
from pdserve.planner.sim.calibration import CalibrationUnavailable, collect_step_samples
from pdserve.planner.sim.latency import calibration_from_measurements


def test_missing_engine_gives_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pdserve", types.ModuleType("pdserve"))
    with pytest.raises(CalibrationUnavailable, match="pdserve engine is not available"):
        collect_step_samples(prompt_lens=(16,), batch_sizes=(1,), decode_tokens=2, repeats=1)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(pdserve, "LLM"), reason="the pdserve engine has not landed")
def test_calibration_on_the_embedded_model_fits() -> None:
    # The smallest run that exercises the real API path; CPU timings are too noisy
    # here for more than sanity checks.
    data = collect_step_samples(
        None, dtype="float32", prompt_lens=(8,), batch_sizes=(1,), decode_tokens=2, repeats=1
    )
    assert len(data["prefill"]) == len(data["decode"]) == 1
    assert (data["prefill"][0]["batch_tokens"], data["prefill"][0]["attention_pairs"]) == (8, 36)
    assert data["prefill"][0]["seconds"] > 0 and data["decode"][0]["seconds"] >= 0
    assert data["decode"][0]["attention_pairs"] == 8 + 1
    calibration = calibration_from_measurements(data)
    assert calibration.prefill.predict(8, 36) == pytest.approx(data["prefill"][0]["seconds"])


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(pdserve, "LLM"), reason="the pdserve engine has not landed")
def test_calibrate_cli_runs_the_engine_with_the_instance_threads(tmp_path, capsys) -> None:
    import json

    import torch

    from pdserve.cli import main

    threads = torch.get_num_threads()
    output = tmp_path / "calibration.json"
    try:
        code = main(
            [
                "bench", "calibrate", "--dtype", "float32", "--prompt-lens", "8",
                "--batch-sizes", "1,2", "--decode-tokens", "2", "--repeats", "1",
                "--num-threads", "1", "--max-num-batched-tokens", "64", "--output", str(output),
            ]
        )  # fmt: skip
        assert torch.get_num_threads() == 1  # what a one-thread instance computes with
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err
    data = json.loads(output.read_text())
    assert [s["batch_tokens"] for s in data["prefill"]] == [8, 16]
    assert data["fitted"]["decode_model"]["intercept_s"] >= 0
