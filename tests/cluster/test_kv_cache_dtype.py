"""`pdserve serve --kv-cache-dtype`: the flag reaches every instance's engine settings
(vLLM's choices, fp8 = fp8_e4m3), a bad choice and FP8 on CUDA are refused in one line,
a pool takes only instances of its KV dtype, and the ready line and `/metrics` name the
KV cache's dtype and bytes per token."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from pdserve.cli import build_parser
from pdserve.cluster.deployment import Deployment, ServeError
from pdserve.cluster.pools import FITTING
from pdserve.cluster.serve import instance_summary
from pdserve.common.messages import InstanceAddress, InstanceInfo
from pdserve.gateway.metrics import GatewayMetrics
from tests.cluster.test_serve_cli import run_cli


def plan_of(*argv: str, gpus: list[str] | None = None) -> Deployment:
    return Deployment.from_args(build_parser().parse_args(["serve", *argv]), [0, 1], gpus)


@pytest.mark.parametrize("choice", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_the_flag_reaches_the_engine_settings_every_instance_shares(choice: str) -> None:
    deployment = plan_of("--kv-cache-dtype", choice)
    assert deployment.engine.kv_cache_dtype == choice
    names = {"auto": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
    assert deployment.engine.kv_dtype_name("bfloat16") == names.get(choice, "float8_e5m2")
    assert "kv_cache_dtype" in FITTING  # a pool's instances share one KV dtype


def test_fp8_on_cuda_is_refused_in_one_line() -> None:
    with pytest.raises(ServeError) as refused:
        plan_of("--kv-cache-dtype", "fp8", gpus=["0"])
    assert str(refused.value) == (
        "kv_cache_dtype fp8 runs on CPU (its C kernels); the CUDA kernels have no FP8 KV "
        "cache (device cuda): use auto there"
    )


def test_an_unknown_choice_is_one_line_naming_the_choices() -> None:
    result = run_cli("--mode", "colocated", "--kv-cache-dtype", "int8")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()[-1:]
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in line
    assert "'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'" in line


def _info(kv_dtype: str, bytes_per_token: int, kv_scales: str = "") -> InstanceInfo:
    address = InstanceAddress("decode-0", "decode", "tcp://127.0.0.1:1")
    return InstanceInfo(
        address, "tcp://127.0.0.1:2", "/models/SmolLM2-135M-Instruct", max_model_len=1024,
        vocab_size=49152, block_size=16, num_blocks=200, max_num_seqs=8, dtype="bfloat16",
        device="cpu", kv_cache_dtype=kv_dtype, kv_bytes_per_token=bytes_per_token,
        kv_scales=kv_scales,
    )  # fmt: skip


def test_the_ready_line_and_metrics_count_the_kv_bytes_per_token() -> None:
    line = instance_summary(_info("float8_e4m3fn", 11520))
    assert line.startswith("pdserve: decode-0: SmolLM2-135M-Instruct, bfloat16 on cpu, ")
    assert "3200 tokens (float8_e4m3fn, 11520 bytes/token), 3 requests" in line
    metrics = GatewayMetrics()
    metrics.deployment.set_kv_cache("decode", "decode-0", "float8_e4m3fn", 11520)
    metrics.deployment.set_kv_cache("prefill", "prefill-0", "bfloat16", 23040)
    page = generate_latest(metrics.registry).decode()
    assert (
        'pdserve:kv_cache_bytes_per_token{instance="decode-0",kv_cache_dtype="float8_e4m3fn",'
        'role="decode"} 11520.0'
    ) in page
    assert 'kv_cache_dtype="bfloat16",role="prefill"} 23040.0' in page


def test_the_ready_line_says_where_fp8_scales_come_from() -> None:
    from pdserve.engine.step_plan import KVGeometry
    from pdserve.instance.loop import kv_scale_source

    def geometry(k: list[float], v: list[float]) -> KVGeometry:
        return KVGeometry(2, 1, 8, 16, "float8_e4m3fn", 4, k_scales=k, v_scales=v)

    assert kv_scale_source(geometry([], []), calculated=False) == ""
    assert kv_scale_source(geometry([1.0, 1.0], [1.0, 1.0]), calculated=False) == "1.0"
    assert kv_scale_source(geometry([0.5, 1.0], [1.0, 1.0]), False) == "the checkpoint's"
    assert kv_scale_source(geometry([0.07, 0.06], [0.01, 0.02]), True) == "measured at load"
    line = instance_summary(_info("float8_e4m3fn", 11520, "measured at load"))
    assert "(float8_e4m3fn, scales measured at load, 11520 bytes/token)" in line


def test_calculated_scales_need_an_fp8_cache_and_join_only_a_pool_that_has_them() -> None:
    assert plan_of("--kv-cache-dtype", "fp8", "--calculate-kv-scales").engine.calculate_kv_scales
    assert "calculate_kv_scales" in FITTING
    with pytest.raises(ServeError, match="needs kv_cache_dtype fp8"):
        plan_of("--calculate-kv-scales")
