"""`--dtype auto`: the checkpoint's dtype, except where a CPU runs another faster at
the same accuracy (float16 → bfloat16 on every CPU; float32 → bfloat16 where the CPU
has bf16 dot products and the kernels are built for it)."""

from __future__ import annotations

import platform

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.kernels import cpu_build


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch):
    def use(flags: set[str]) -> None:
        monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)

    return use


def test_float32_runs_in_bfloat16_where_the_cpu_has_bf16_dot_products(bf16_cpu) -> None:
    bf16_cpu({"avx2", "avx512f", "avx512_bf16"})
    assert EngineConfig().dtype_name("float32") == "bfloat16"
    assert EngineConfig().dtype_name(None) == "bfloat16"
    assert EngineConfig(dtype="float32").dtype_name("float32") == "float32"


def test_float32_stays_without_bf16_dot_products(bf16_cpu) -> None:
    bf16_cpu({"avx2", "fma", "avx512f"})
    assert EngineConfig().dtype_name("float32") == "float32"
    assert EngineConfig().dtype_name("float16") == "bfloat16"
    assert EngineConfig().dtype_name("bfloat16") == "bfloat16"


def test_forced_avx2_kernels_keep_float32(bf16_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    bf16_cpu({"avx2", "avx512_bf16"})
    monkeypatch.setenv(cpu_build.ISA_VARIABLE, "avx2")
    assert EngineConfig().dtype_name("float32") == "float32"


def test_a_gpu_keeps_the_checkpoint_dtype(bf16_cpu) -> None:
    bf16_cpu({"avx512_bf16"})
    assert EngineConfig(device="cuda").dtype_name("float32") == "float32"
    assert EngineConfig(device="cuda").dtype_name("float16") == "float16"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 feature names")
def test_this_machines_flags_are_read() -> None:
    assert {"sse2", "avx2"} <= cpu_build.cpu_flags()
