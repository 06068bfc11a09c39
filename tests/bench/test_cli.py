"""The `pdserve bench` and `pdserve plan` command lines."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main


def run(command: str, *more: str) -> int:
    """`pdserve <command> <more>`: the command split at spaces, then `more` as is (URLs
    and paths)."""
    return main([*command.split(), *more])


VLLM_FIELDS = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "errors",
    "duration",
    "max_concurrency",
    "request_rate",
    "burstiness",
)


def test_bench_serve_help_lists_vllm_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--base-url",
        "--dataset-name",
        "--random-range-ratio",
        "--burstiness",
        "--max-concurrency",
        "--percentile-metrics",
        "--metric-percentiles",
        "--goodput",
        "--ignore-eos",
        "--save-result",
        "--result-filename",
    ):
        assert flag in text


def test_bench_serve_saves_vllm_shaped_json(scripted_server, tmp_path, capsys) -> None:
    scripted_server.script(ttft_s=0.02, itl_s=0.005)
    path = tmp_path / "result.json"
    code = run(
        "bench serve --num-prompts 5 --random-input-len 12 --random-output-len 6 "
        "--max-concurrency 2 --goodput ttft:1000 tpot:500 --metric-percentiles 50,99 "
        "--disable-tqdm --save-result",
        *("--base-url", scripted_server.base_url, "--result-filename", str(path)),
    )
    assert code == 0
    result = json.loads(path.read_text())
    for field in VLLM_FIELDS:
        assert field in result, field
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in result
    assert result["completed"] == 5 and result["total_output_tokens"] == 30
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["max_concurrency"] == 2 and result["request_rate"] == "inf"
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_serve_against_nothing_reports_failures(refused_url, capsys) -> None:
    code = run(
        "bench serve --num-prompts 3 --random-input-len 8 --random-output-len 2 --disable-tqdm",
        *("--base-url", refused_url),
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "Failed requests:" in out and "ConnectError" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--goodput", "ttft"], "goodput SLO 'ttft' must look like NAME:MILLISECONDS"),
        (["--dataset-name", "sharegpt"], "dataset 'sharegpt' needs --dataset-path"),
        (["--metric-percentiles", "0,150"], "percentiles '0,150' must lie in (0, 100]"),
    ],
)
def test_bad_bench_input_is_one_line(refused_url, capsys, argv, message) -> None:
    code = main(["bench", "serve", "--base-url", refused_url, "--num-prompts", "2", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"pdserve bench serve: error: {message}"


@pytest.mark.slow
def test_bench_sweep_reduced_writes_json_and_png(scripted_server, tmp_path, capsys) -> None:
    scripted_server.script(ttft_s=0.005, itl_s=0.002)
    path = tmp_path / "sweep.json"
    code = run(
        "bench sweep --reduced --random-input-len 8 --random-output-len 4 --disable-tqdm",
        *("--base-url", scripted_server.base_url, "--result-filename", str(path)),
    )
    assert code == 0
    result = json.loads(path.read_text())
    assert result["config"]["concurrency_steps"] == [1, 2, 4, 8]
    assert all(step["completed"] == 20 for step in result["steps"])
    assert result["working_point"] is not None
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "working point" in capsys.readouterr().out


def write_config(tmp_path, **overrides) -> str:
    config = {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        **overrides,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "config.json")


def plan_json(capsys, flags: str, *more: str) -> dict:
    """`pdserve plan --json <flags> <more>`, which must succeed: the plan it printed."""
    assert run(f"plan --json {flags}", *more) == 0
    return json.loads(capsys.readouterr().out)


# A model small enough for the simulator to step quickly.
SMALL_MODEL = {
    "num_hidden_layers": 2,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "intermediate_size": 1024,
    "vocab_size": 1000,
}


def test_plan_json_carries_memory_capacity_and_cost(tmp_path, capsys) -> None:
    plan = plan_json(
        capsys,
        "--max-num-seqs 32 --tensor-parallel-size 4 --requests-per-minute 600 "
        "--prompt-tokens 2000 --output-tokens 200 --prefill-tokens-per-s 2500 "
        "--decode-tokens-per-s 250 --target-utilization 0.7 --gpu-hourly-price 2",
        *("--model", write_config(tmp_path)),
    )
    assert plan["memory"]["kv_bytes_per_token"] == 320 * 1024
    assert plan["memory"]["tp_needed_for_max_num_seqs"] == 4
    capacity = plan["capacity"]
    # 20,000 input tok/s over 4 x 2,500 per instance: 2 instances at full load, 3 at 70%.
    assert capacity["prefill_gpus_at_full_load"] == pytest.approx(8.0)
    assert capacity["at_target_utilization"][0]["prefill_instances"] == 3
    assert capacity["at_target_utilization"][0]["decode_instances"] == 3
    cost = plan["cost"][0]["disaggregated"]
    assert cost["gpus"] == 24 and cost["cost_per_hour"] == pytest.approx(48.0)


def test_plan_prints_tables_and_rejects_bad_input(tmp_path, capsys) -> None:
    assert main(["plan", "--model", write_config(tmp_path)]) == 0
    assert "KV cache per token    320.0 KiB" in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip().startswith("pdserve plan: error: no config.json")
    assert main(["plan", "--model", write_config(tmp_path), "--requests-per-minute", "5"]) == 2
    assert "needs --requests-per-minute, --prompt-tokens" in capsys.readouterr().err


def test_plan_with_a_calibration_simulates_and_searches(tmp_path, capsys) -> None:
    prefill = [
        {"batch_tokens": n, "attention_pairs": 0, "seconds": 0.01 + 1e-4 * n}
        for n in (256, 1024, 4096)
    ]
    decode = [
        {"batch_tokens": b, "attention_pairs": 0, "seconds": 0.01 + 1e-3 * b} for b in (1, 8, 32)
    ]
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"tp": 1, "prefill": prefill, "decode": decode}))
    model = write_config(tmp_path, **SMALL_MODEL)
    plan = plan_json(
        capsys,
        "--tensor-parallel-size 1 --requests-per-minute 120 --prompt-tokens 1000 "
        "--output-tokens 20 --ttft-slo-ms 2000 --itl-slo-ms 50 --simulate-requests 100 "
        "--search-max-gpus 2",
        *("--model", model, "--calibration", str(calibration)),
    )
    capacity = plan["capacity"]
    # Prefill: 8192-token steps take 0.01 + 0.8192 s. Decode: the largest batch whose
    # step stays within 50 ms is 40 (0.01 + 0.040 s), giving 800 tok/s.
    assert capacity["prefill_tokens_per_s_per_gpu"] == pytest.approx(8192 / 0.8292)
    assert capacity["decode_tokens_per_s_per_gpu"] == pytest.approx(800.0)
    assert capacity["throughput_source"] == "calibration (decode batch 40)"
    simulated = plan["simulation"]
    assert simulated["disaggregated"]["completed"] == 100
    assert simulated["colocated"]["deployment"].endswith("colocated x TP1")
    assert {row["deployment"] for row in simulated["placement_search"]} == {
        "1 colocated x TP1",
        "2 colocated x TP1",
        "1P+1D x TP1",
    }
