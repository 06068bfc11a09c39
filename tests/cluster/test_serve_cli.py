"""`pdserve serve` flags and the plan they make, without starting instances."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.cluster.deployment import Deployment, ServeError, parse_size, place
from pdserve.kvtransfer.config import KVTransferConfig


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", *argv],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096),
     ("64 KiB", 64 << 10), ("1tib", 1 << 40)],
)  # fmt: skip
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "2XB", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ServeError):
        parse_size(text)


def test_defaults_match_vllm_serve_and_bind_locally() -> None:
    args = parse()
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert (args.num_prefill, args.num_decode, args.mode) == (1, 1, "disaggregated")
    assert args.enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    assert args.model is None and args.launcher == "ray"


def test_colocated_plan_threads_and_engine_config() -> None:
    args = parse("--mode", "colocated", "--kv-cache-memory", "256MiB", "--max-num-seqs", "8")
    plan = Deployment.from_args(args, cores=[0, 1])
    assert [i.instance_id for i in plan.instances] == ["colocated-0", "colocated-1"]
    assert [i.num_threads for i in plan.instances] == [1, 1]  # max(1, 2 // 2)
    assert all(i.cpus == [] for i in plan.instances)  # one core each: not pinned
    assert plan.engine.kv_cache_memory == 256 << 20
    assert plan.engine.max_num_seqs == 8
    assert plan.served_model_names == ["SmolLM2-135M-Instruct"]
    single = Deployment.from_args(parse("--mode", "colocated", "--num-colocated", "1"), [0, 1])
    assert [i.num_threads for i in single.instances] == [2]
    assert plan.engine.enforce_eager is False  # decode steps recorded (CPU) or graphed
    eager = Deployment.from_args(parse("--mode", "colocated", "--enforce-eager"), [0, 1])
    assert eager.engine.enforce_eager is True
    assert plan.engine.scheduling_policy == "fcfs"
    lpm = Deployment.from_args(parse("--mode", "colocated", "--scheduling-policy", "lpm"), [0, 1])
    assert lpm.engine.scheduling_policy == "lpm"


def test_place_pins_when_each_instance_has_two_cores_or_more() -> None:
    planned = place(["prefill", "decode", "decode"], list(range(8)))
    assert [p.instance_id for p in planned] == ["prefill-0", "decode-0", "decode-1"]
    assert [p.num_threads for p in planned] == [2, 2, 2]
    assert [p.cpus for p in planned] == [[0, 1], [2, 3], [4, 5]]
    crowded = place(["colocated"] * 3, [0, 1])
    assert [p.num_threads for p in crowded] == [1, 1, 1]
    assert sum(p.num_cpus for p in crowded) == pytest.approx(2.0)  # Ray can place them all
    assert [p.num_threads for p in place(["colocated"], [0, 1, 2, 3], threads=1)] == [1]


def test_the_default_plan_is_one_prefill_and_one_decode_instance() -> None:
    plan = Deployment.from_args(parse(), cores=[0, 1])
    assert [(i.instance_id, i.role) for i in plan.instances] == [
        ("prefill-0", "prefill"), ("decode-0", "decode")]  # fmt: skip
    assert [i.num_threads for i in plan.instances] == [1, 1]
    assert plan.args.kv_transport == "ucx"
    assert limits(plan.kv_transfer) == {
        "transport": "ucx", "failure_policy": "recompute", "lease_s": 30.0,
        "transfer_timeout_s": 10.0, "heartbeat_interval_s": 2.0,
        "handshake_timeout_s": 5.0}  # fmt: skip
    short = Deployment.from_args(parse("--kv-lease-seconds", "4", "--kv-failure-policy", "fail"))
    assert limits(short.kv_transfer) == {
        "transport": "ucx", "failure_policy": "fail", "lease_s": 4.0, "transfer_timeout_s": 2.0,
        "heartbeat_interval_s": 1.0, "handshake_timeout_s": 2.0}  # fmt: skip
    assert Deployment.from_args(parse("--mode", "colocated")).kv_transfer is None


def limits(config: KVTransferConfig | None) -> dict:
    """The settings the flags set (the id and host are each instance's own)."""
    assert config is not None
    names = ("transport", "failure_policy", "lease_s", "transfer_timeout_s")
    names += ("heartbeat_interval_s", "handshake_timeout_s")
    return {name: getattr(config, name) for name in names}


def test_liveness_flags_reach_the_global_scheduler() -> None:
    args = parse()
    assert (args.request_timeout, args.max_request_retries) == (0.0, 2)
    config = Deployment.from_args(args).scheduler
    assert (config.max_attempts, config.instance_stall_timeout_s) == (3, 120.0)
    flags = ("--max-request-retries", "0", "--instance-stall-timeout", "0")
    config = Deployment.from_args(parse(*flags)).scheduler
    assert (config.max_attempts, config.instance_stall_timeout_s) == (1, 0.0)


@pytest.mark.parametrize("slo", ["0", "-5", "nan", "inf"])
def test_the_ttft_slo_must_be_a_positive_number_of_milliseconds(slo: str) -> None:
    assert parse().ttft_slo_ms is None  # no SLO unless given: nothing is exported
    assert parse("--ttft-slo-ms", "800").ttft_slo_ms == 800.0
    with pytest.raises(ServeError, match="--ttft-slo-ms must be a positive number"):
        Deployment.from_args(parse("--ttft-slo-ms", slo))


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--mode", "colocated", "-tp", "2"], "--tensor-parallel-size: "),
        (["-tp", "2"], "--tensor-parallel-size: "),
        (["--decode-tensor-parallel-size", "2"], "--decode-tensor-parallel-size: "),
    ],
)
def test_a_tensor_parallel_refusal_names_the_flag_that_was_given(
    flags: list[str], named: str
) -> None:
    with pytest.raises(ServeError) as refused:
        Deployment.from_args(parse(*flags))
    assert str(refused.value).startswith(named), refused.value
    assert "does not divide the model's 3 KV heads" in str(refused.value)


def test_inconsistent_kv_transfer_limits_fail_with_one_line() -> None:
    result = run_cli("--kv-lease-seconds", "2", "--kv-transfer-timeout", "3")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pdserve serve: error: --kv-lease-seconds / --kv-transfer-timeout: "
        "transfer_timeout_s must be in (0, lease_s), got 3.0"
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-memory", "lots"], "cannot read 'lots' as a size"),
        (["--model", "/no/such/folder"], "no such checkpoint folder"),
        (["--block-size", "0"], "--block-size must be at least 1"),
        (["--skip-prefill-min-cached-ratio", "2"], "min_cached_ratio"),
        (["--request-timeout", "-1"], "--request-timeout must be >= 0"),
        (["--max-request-retries", "-1"], "--max-request-retries must be >= 0"),
        (["--quantization", "int4"], "quantization must be one of int8; got 'int4'"),
    ],
)
def test_bad_flags_fail_with_one_line(flags: list[str], message: str) -> None:
    result = run_cli("--mode", "colocated", *flags)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_taken_port_fails_before_anything_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--mode", "colocated", "--launcher", "local", "--port", str(port))
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_asking_for_a_gpu_where_none_is_visible_fails_with_one_line() -> None:
    result = run_cli("--device", "cuda", env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pdserve serve: error: --device cuda: no GPU visible (CUDA_VISIBLE_DEVICES, "
        "nvidia-smi); use --device cpu"
    ]
