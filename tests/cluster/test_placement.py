"""Placing instances on cores and GPUs, and the specs and load waves that follow."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.cluster.deployment import Deployment, ServeError
from pdserve.cluster.local_launcher import LocalLauncher
from pdserve.cluster.placement import (
    PlacementError,
    available_gpus,
    load_waves,
    place,
    place_on_gpus,
    resolve_device,
)
from pdserve.cluster.serve import describe, instance_specs
from pdserve.engine.config import EngineConfig
from tests.cluster.gpu_plans import PLANS, plan_id
from tests.engine.test_devices import started_devices

TWO_GPUS = "GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)\n"


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("visible", "ids"),
    [("0,1", ["0", "1"]), ("3", ["3"]), ("", []), ("-1", []), ("2,-1,3", ["2"]),
     ("GPU-a, GPU-b", ["GPU-a", "GPU-b"])],
)  # fmt: skip
def test_visible_devices_decide_the_gpus(visible: str, ids: list[str]) -> None:
    assert available_gpus({"CUDA_VISIBLE_DEVICES": visible}) == ids


def test_without_visible_devices_nvidia_smi_lists_the_gpus(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert available_gpus({}) == []  # no nvidia-smi: a CPU machine
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{TWO_GPUS}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    assert available_gpus({}) == ["0", "1"]
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert available_gpus({}) == []


def test_the_device_follows_the_hardware_unless_asked() -> None:
    assert resolve_device("auto", []) == "cpu"
    assert resolve_device("auto", ["0"]) == "cuda"
    assert resolve_device("cpu", ["0"]) == "cpu"
    with pytest.raises(PlacementError, match="--device cuda: no GPU visible"):
        resolve_device("cuda", [])


def test_one_gpu_is_shared_with_a_memory_budget_each() -> None:
    planned = place_on_gpus(place(["prefill", "decode"], [0, 1]), ["0"], 0.9)
    assert [(p.device, p.gpus, p.num_gpus) for p in planned] == [
        ("cuda", ("0",), 0.5), ("cuda", ("0",), 0.5)]  # fmt: skip
    assert [p.gpu_memory_utilization for p in planned] == pytest.approx([0.45, 0.45])
    # They load one after the other: each sizes its KV cache from the free memory.
    assert [[p.instance_id for p in wave] for wave in load_waves(planned)] == [
        ["prefill-0"], ["decode-0"]]  # fmt: skip


def test_enough_gpus_give_one_instance_each() -> None:
    planned = place_on_gpus(place(["prefill", "decode"], list(range(16))), ["4", "5", "6"], 0.8)
    assert [(p.gpus, p.num_gpus, p.gpu_memory_utilization) for p in planned] == [
        (("4",), 1.0, 0.8), (("5",), 1.0, 0.8)]  # fmt: skip
    assert [len(wave) for wave in load_waves(planned)] == [2]
    assert [p.cpus for p in planned] == [list(range(8)), list(range(8, 16))]


def test_more_instances_than_gpus_share_round_robin() -> None:
    roles = ["prefill", "prefill", "decode"]
    planned = place_on_gpus(place(roles, [0, 1, 2]), ["0", "1"], 0.9)
    assert [(p.instance_id, p.gpus, p.num_gpus) for p in planned] == [
        ("prefill-0", ("0",), 0.5), ("prefill-1", ("1",), 1.0), ("decode-0", ("0",), 0.5),
    ]  # fmt: skip
    assert sum(p.num_gpus for p in planned) == pytest.approx(2.0)  # Ray can place them all
    assert [[p.instance_id for p in w] for w in load_waves(planned)] == [
        ["prefill-0", "prefill-1"], ["decode-0"]]  # fmt: skip


def test_cpu_instances_load_together() -> None:
    planned = place(["colocated"] * 3, [0, 1])
    assert [len(wave) for wave in load_waves(planned)] == [3]
    assert all(p.device == "cpu" and p.gpus == () and p.num_gpus == 0 for p in planned)


def test_the_plan_puts_instances_on_the_gpus_it_is_given() -> None:
    plan = Deployment.from_args(parse("--gpu-memory-utilization", "0.8"), [0, 1], gpus=["0"])
    assert plan.engine.device == "cuda"
    assert [p.gpu_memory_utilization for p in plan.instances] == pytest.approx([0.4, 0.4])
    assert "prefill-0 (GPU 0, 0.40 of its memory)" in describe(plan)
    on_cpu = Deployment.from_args(parse("--device", "cpu"), [0, 1], gpus=["0"])
    assert on_cpu.engine.device == "cpu"
    assert all(p.gpus == () for p in on_cpu.instances)
    assert Deployment.from_args(parse(), [0, 1], gpus=[]).engine.device == "cpu"
    with pytest.raises(ServeError, match="no GPU visible"):
        Deployment.from_args(parse("--device", "cuda"), [0, 1], gpus=[])


def test_specs_carry_the_device_budget_and_visible_gpu() -> None:
    plan = Deployment.from_args(parse(), [0, 1], gpus=["2"])
    waves = instance_specs(plan, "/model", "tcp://127.0.0.1:1")
    assert [[s.instance_id for s in wave] for wave in waves] == [["prefill-0"], ["decode-0"]]
    first = waves[0][0]
    assert first.gpus == ["2"]
    assert first.engine.device == "cuda"
    assert first.engine.gpu_memory_utilization == pytest.approx(0.45)
    env = LocalLauncher(env={"PATH": os.defpath, "CUDA_VISIBLE_DEVICES": "0,1,2"}).child_env(first)
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    # Ray sets an actor's CUDA_VISIBLE_DEVICES from its num_gpus; the spec leaves it alone.
    ray_waves = instance_specs(plan, "/model", "tcp://127.0.0.1:1", ray=True)
    assert all(spec.gpus == [] for wave in ray_waves for spec in wave)
    cpu_plan = Deployment.from_args(parse(), [0, 1], gpus=[])
    (cpu_wave,) = instance_specs(cpu_plan, "/model", "tcp://127.0.0.1:1")
    default = EngineConfig().gpu_memory_utilization  # not set on CPU
    assert all(s.engine.gpu_memory_utilization == default for s in cpu_wave)
    assert "CUDA_VISIBLE_DEVICES" not in LocalLauncher(env={}).child_env(cpu_wave[0])


@pytest.mark.parametrize("plan", PLANS, ids=[plan_id(p) for p in PLANS])
def test_each_rank_gets_a_gpu_of_its_own(plan, split_model: str, monkeypatch) -> None:
    """The local launcher shows an instance of W = TP x PP ranks W GPUs, rank r uses the
    r-th of them, and the plan counts W GPUs for it; single-rank instances share a GPU
    when there are fewer GPUs than instances."""
    num_gpus, tp, pp, expected = plan
    argv = parse("--model", split_model, "-tp", str(tp), "-pp", str(pp))
    gpus = [str(i) for i in range(num_gpus)]
    if isinstance(expected, str):
        with pytest.raises(ServeError, match=expected) as refused:
            Deployment.from_args(argv, list(range(16)), gpus=gpus)
        assert "\n" not in str(refused.value)
        return
    ranks = tp * pp
    deployment = Deployment.from_args(argv, list(range(16)), gpus=gpus)
    specs = [spec for wave in instance_specs(deployment, split_model, "tcp://g:1") for spec in wave]
    launcher = LocalLauncher(env={"CUDA_VISIBLE_DEVICES": ",".join(gpus)})
    visible = tuple(launcher.child_env(spec)["CUDA_VISIBLE_DEVICES"] for spec in specs)
    assert visible == expected
    shared = ranks == 1 and num_gpus == 1
    assert [p.num_gpus for p in deployment.instances] == [0.5 if shared else float(ranks)] * 2
    assert [p.gpu_memory_utilization for p in deployment.instances] == pytest.approx(
        [0.45 if shared else 0.9] * 2
    )
    if ranks > 1:
        for spec, seen in zip(specs, visible, strict=True):
            devices = started_devices(spec.engine, seen, monkeypatch)
            assert devices == [f"cuda:{r}" for r in range(ranks)]


def test_single_rank_instances_share_what_the_groups_leave() -> None:
    roles = ["prefill", "prefill", "decode"]
    planned = place_on_gpus(place(roles, [0, 1, 2]), ["0", "1", "2"], 0.9, {"decode": 2})
    assert [(p.instance_id, p.gpus, p.num_gpus) for p in planned] == [
        ("prefill-0", ("2",), 0.5), ("prefill-1", ("2",), 0.5), ("decode-0", ("0", "1"), 2.0),
    ]  # fmt: skip
    assert [p.gpu_memory_utilization for p in planned] == pytest.approx([0.45, 0.45, 0.9])
    assert [[p.instance_id for p in w] for w in load_waves(planned)] == [
        ["prefill-0", "decode-0"], ["prefill-1"]]  # fmt: skip
    with pytest.raises(PlacementError, match=r"need 3 GPUs and 2 are there.*\(decode-0: 2\)"):
        place_on_gpus(place(roles, [0, 1, 2]), ["0", "1"], 0.9, {"decode": 2})


def test_the_summary_names_each_instances_gpus(split_model: str) -> None:
    argv = parse("--model", split_model, "--decode-tensor-parallel-size", "2")
    plan = Deployment.from_args(argv, [0, 1], gpus=["0", "1", "2"])
    assert describe(plan) == (
        "prefill-0 (GPU 2, 0.90 of its memory), decode-0 (GPUs 0,1, 0.90 of their memory)"
    )
