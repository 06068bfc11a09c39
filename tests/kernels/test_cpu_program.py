"""A program of C kernel calls (kernels/cpu_program.py, kernels/cpu/program.c): recorded
through the ops' own bindings, it computes what the calls made one by one compute, again
on new inputs; a failing call stops it with that call's own error."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.rope import cos_sin_cache
from pdserve.kernels.cpu_layer_ops import CpuLayerOps
from pdserve.kernels.cpu_program import CpuProgram
from tests.kernels.paged import make_paged_batch


def test_a_recorded_chain_computes_the_calls_again_on_new_inputs(kernels, threads):
    threads(2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    norm_weight = torch.randn(64, generator=gen)
    weight = torch.randn(2 * 48, 64, generator=gen).to(torch.bfloat16)
    program = CpuProgram(kernels)
    recorder = program.recorder()
    normed = CpuLayerOps(recorder).rms_norm(x, norm_weight, 1e-5)
    projected = recorder.linear(normed, weight)
    out = CpuLayerOps(recorder).silu_and_mul(projected)
    assert len(program) == 3
    ops = CpuLayerOps(kernels)
    for _ in range(3):
        program.run()
        want = ops.silu_and_mul(kernels.linear(ops.rms_norm(x, norm_weight, 1e-5), weight))
        assert torch.equal(out, want)
        x.copy_(torch.randn(3, 64, generator=gen))  # the next step's input, same buffer
    with pytest.raises(RuntimeError, match="sealed"):
        recorder.linear(normed, weight)


def test_an_op_that_runs_its_reference_records_nothing(kernels):
    program = CpuProgram(kernels)
    CpuLayerOps(program.recorder()).rms_norm(torch.randn(2, 4), torch.ones(4), 1e-5)
    assert len(program) == 0  # rows under 8 elements: torch computed it, at once


def test_a_failing_call_stops_the_program_with_its_own_error(kernels):
    gen = torch.Generator().manual_seed(1)
    batch = make_paged_batch([5], 2, 16, 16, torch.float32, gen, spare_blocks=2)
    qkv = torch.randn(1, (4 + 2 * 2) * 16, generator=gen)
    positions = torch.tensor([3])
    slots = torch.tensor([7])
    program = CpuProgram(kernels)
    recorder = program.recorder()
    table = cos_sin_cache(16, 64, 10000.0, None)
    q = CpuLayerOps(recorder).rotary_write_kv_cache(positions, qkv, table, batch.kv_cache, slots, 4)
    normed = CpuLayerOps(recorder).rms_norm(q.view(1, 64), torch.ones(64), 1e-5)
    program.run()
    assert normed.abs().sum() > 0
    normed.zero_()
    positions[0] = 64  # past the cos/sin table
    with pytest.raises(ValueError, match=r"positions\[0\] is outside the cos/sin cache"):
        program.run()
    assert normed.abs().sum() == 0  # the norm after it never ran


def test_outputs_go_to_the_rows_given_and_bad_ones_are_refused(kernels):
    from pdserve.kernels.cpu_quantized import CpuQuantizedLinear

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen)
    weight = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    wide = torch.zeros(8, 40)
    got = kernels.linear(x, weight, None, wide[:3])
    assert got.data_ptr() == wide.data_ptr() and torch.equal(wide[:3], kernels.linear(x, weight))
    assert wide[3:].abs().sum() == 0
    scales = torch.ones(40, 1)
    int8 = torch.randint(-127, 128, (40, 64), generator=gen, dtype=torch.int8)
    quantized = CpuQuantizedLinear(kernels)
    with pytest.raises(ValueError, match=r"out must be float32 \[3, 40\]"):
        quantized.linear_int8(x, int8, scales, None, torch.zeros(3, 41))
    ops = CpuLayerOps(kernels)
    normed = torch.zeros(3, 64)
    residual = torch.randn(3, 64, generator=gen)
    want = ops.rms_norm(x, torch.ones(64), 1e-5, residual)
    ops.rms_norm(x, torch.ones(64), 1e-5, residual, normed, residual)  # the sum in place
    assert torch.equal(normed, want[0]) and torch.equal(residual, want[1])
    with pytest.raises(ValueError, match="out must be float32"):
        ops.silu_and_mul(torch.randn(2, 64), torch.zeros(2, 64))
