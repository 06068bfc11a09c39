"""The line `pdserve serve` prints per instance when it is ready: model, dtype, device,
KV blocks and tokens, and how many requests of full length fit at once. The facts come
in the instance's InstanceInfo (a step loop over a fake executor here; no model)."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve.cluster.serve import instance_summary
from pdserve.common.messages import InstanceAddress, InstanceInfo
from tests.instance.test_step_loop import Harness


def test_a_loaded_instance_reports_dtype_and_device() -> None:
    harness = Harness("colocated")
    try:
        info = harness.loop.info()
    finally:
        harness.close()
    assert (info.dtype, info.device) == ("float32", "cpu")
    assert (info.num_blocks, info.block_size, info.max_model_len) == (64, 4, 256)


def test_the_summary_names_the_kv_cache_and_how_many_full_requests_fit() -> None:
    address = InstanceAddress("decode-0", "decode", "tcp://127.0.0.1:1")
    info = InstanceInfo(
        address, "tcp://127.0.0.1:2", "/models/SmolLM2-135M-Instruct", max_model_len=1024,
        vocab_size=49152, block_size=16, num_blocks=200, max_num_seqs=8,
        dtype="bfloat16", device="cuda", kernels="Triton kernels",
    )  # fmt: skip
    line = instance_summary(info)
    assert "\n" not in line
    assert line.startswith("pdserve: decode-0: SmolLM2-135M-Instruct, bfloat16 on cuda")
    assert "200 KV blocks x 16 = 3200 tokens" in line
    assert "3 requests of 1024 tokens (max_model_len) fit at once" in line
    assert line.endswith("; kernels: Triton kernels")


def test_the_summary_names_the_weight_bytes_and_their_quantization() -> None:
    address = InstanceAddress("colocated-0", "colocated", "tcp://127.0.0.1:1")
    info = InstanceInfo(
        address, "tcp://127.0.0.1:2", "/models/SmolLM2-135M-Instruct", max_model_len=1024,
        vocab_size=49152, block_size=16, num_blocks=200, max_num_seqs=8,
        dtype="float32", device="cpu", weight_bytes=220_177_152, quantization="int8",
    )  # fmt: skip
    line = instance_summary(info)
    assert line.startswith(
        "pdserve: colocated-0: SmolLM2-135M-Instruct, float32 on cpu, weights 210 MiB (int8), "
        "200 KV blocks"
    )


def test_serve_refuses_a_kv_cache_short_of_one_full_request() -> None:
    # 4 MiB hold 5 fp32 blocks (80 tokens) of the embedded model, whose max_model_len
    # is 8192: the instance fails to load and `pdserve serve` says why in one line.
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--launcher", "local", "--port", "0",
         "--mode", "colocated", "--num-colocated", "1", "--threads-per-instance", "1",
         "--dtype", "float32", "--kv-cache-memory", "4MiB", "--block-size", "16"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        "pdserve serve: error: colocated-0 failed to start: ValueError: the KV cache holds "
        "5 blocks x 16 = 80 tokens, fewer than one request of max_model_len 8192: raise "
        "--kv-cache-memory or lower --max-model-len"
    ]
    assert "Traceback" not in result.stderr
