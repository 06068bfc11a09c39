"""The Triton kernels as torch operators (`kernels/cuda_ops.py`): their implementations
give the references' results (CPU tensors, Triton's interpreter); their fake
implementations give outputs of the kernels' shapes, dtypes and device for `cuda`
fake tensors, and refuse what a launch refuses (a host tensor among device tensors, an
index tensor of a float dtype, a shape that does not fit); `torch.library.opcheck`
finds the schemas (mutated arguments) and the fakes true to the implementations."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pdserve.kernels import cuda_ops, dispatch, reference
from pdserve.kernels.triton_decode import decode_attention_kernel
from tests.engine.fake_cuda import load_device_guard
from tests.kernels.paged import assert_matches, make_paged_batch, poisoned_like, require_interpreter

BS, KVH, HEADS, D = 16, 2, 4, 32
CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True, scope="module")
def device_guard() -> None:
    load_device_guard()  # slicing a `cuda` tensor takes the CUDA device guard


def _decode_args() -> dict:
    gen = torch.Generator().manual_seed(0)
    batch = make_paged_batch([1, 17, 40], KVH, D, BS, torch.bfloat16, gen)
    return {
        "query": torch.randn(3, HEADS, D, generator=gen).to(torch.bfloat16),
        "kv_cache": batch.kv_cache,
        "block_tables": batch.block_tables,
        "context_lens": batch.context_lens,
    }


def _on_fake_cuda(args: dict) -> dict:
    """Empty tensors of the args' shapes, dtypes and strides on the fake device (call
    inside the mode)."""
    return {
        name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
        for name, t in args.items()
    }


def _prefill_args() -> dict:
    """Two sequences: 5 new tokens over 21 of context, and a whole prompt of 9."""
    gen = torch.Generator().manual_seed(1)
    batch = make_paged_batch([21, 9], KVH, D, BS, torch.float32, gen)
    return {
        "query": torch.randn(14, HEADS, D, generator=gen),
        "kv_cache": batch.kv_cache,
        "block_tables": batch.block_tables,
        "query_start_loc": torch.tensor([0, 5, 14], dtype=torch.int32),
        "context_lens": batch.context_lens,
    }


def test_the_operators_compute_what_the_references_do() -> None:
    require_interpreter(decode_attention_kernel)
    args = _decode_args()
    out = poisoned_like(args["query"])
    got = cuda_ops.decode_attention(*args.values(), D**-0.5, None, out)
    assert got is out
    assert_matches(got, reference.decode_attention_ref(*args.values(), D**-0.5), torch.bfloat16)
    args = _prefill_args()
    want = reference.prefill_attention_ref(*args.values(), D**-0.5, 7)
    assert_matches(cuda_ops.prefill_attention(*args.values(), D**-0.5, 7), want, torch.float32)
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
    for got, want in zip(
        cuda_ops.rms_norm(x, weight, 1e-5, residual),
        reference.rms_norm_ref(x, weight, 1e-5, residual),
        strict=True,
    ):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        cuda_ops.rms_norm(x, weight, 1e-5), reference.rms_norm_ref(x, weight, 1e-5)
    )
    positions = torch.tensor([0, 5, 9])
    q, k, cos_sin = torch.randn(3, HEADS, D), torch.randn(3, KVH, D), torch.randn(16, D)
    for got, want in zip(
        cuda_ops.rotary_embedding(positions, q, k, cos_sin),
        reference.rotary_embedding_ref(positions, q, k, cos_sin),
        strict=True,
    ):
        torch.testing.assert_close(got, want)
    cache = torch.zeros(4, 3, 2, KVH, BS, D)[:, 1]  # a layer's block-strided view
    key, value = torch.randn(2, KVH, D), torch.randn(2, KVH, D)
    slots = torch.tensor([17, -1])
    cuda_ops.write_kv_cache(key, value, cache, slots)
    want = torch.zeros_like(cache)
    reference.write_kv_cache_ref(key, value, want, slots)
    torch.testing.assert_close(cache, want)


def test_opcheck_finds_the_schemas_and_fakes_true_to_the_kernels() -> None:
    tests = ("test_schema", "test_faketensor")
    args = _decode_args()
    out = torch.empty_like(args["query"])
    torch.library.opcheck(
        torch.ops.pdserve.decode_attention.default,
        (*args.values(), D**-0.5, None, out),
        test_utils=tests,
    )
    args = _prefill_args()
    out = torch.empty_like(args["query"])
    torch.library.opcheck(
        torch.ops.pdserve.prefill_attention.default,
        (*args.values(), 0.2, None, out),
        test_utils=tests,
    )
    x, weight = torch.randn(3, 64, dtype=torch.bfloat16), torch.rand(64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pdserve.rms_norm.default, (x, weight, 1e-5), test_utils=tests)
    torch.library.opcheck(
        torch.ops.pdserve.rms_norm_residual.default, (x, weight, 1e-5, x.clone()), test_utils=tests
    )
    rotary = (
        torch.tensor([0, 5]),
        torch.randn(2, HEADS, D),
        torch.randn(2, KVH, D),
        torch.randn(8, D),
    )
    torch.library.opcheck(torch.ops.pdserve.rotary_embedding.default, rotary, test_utils=tests)
    cache = torch.zeros(4, 3, 2, KVH, BS, D)[:, 1]
    write = (torch.randn(2, KVH, D), torch.randn(2, KVH, D), cache, torch.tensor([3, 40]))
    torch.library.opcheck(torch.ops.pdserve.write_kv_cache.default, write, test_utils=tests)


def test_fakes_make_device_outputs_of_the_kernels_shapes() -> None:
    assert dispatch.load_triton_kernels()
    host = _decode_args()
    with FakeTensorMode():
        args = _on_fake_cuda(host)
        decode = dispatch.lookup("decode_attention", args["query"])
        out = decode(*args.values(), 0.1)
        assert (out.shape, out.dtype, out.device) == ((3, HEADS, D), torch.bfloat16, CUDA)
        x = torch.empty(5, 64, device="cuda", dtype=torch.bfloat16)
        weight = torch.empty(64, device="cuda", dtype=torch.float32)
        normed, residual = dispatch.lookup("rms_norm", x)(x, weight, 1e-5, x)
        assert (normed.dtype, residual.dtype, normed.device) == (
            torch.float32,
            torch.bfloat16,
            CUDA,
        )
        positions = torch.empty(5, device="cuda", dtype=torch.int64)
        q, k = torch.empty(5, HEADS, D, device="cuda"), torch.empty(5, KVH, D, device="cuda")
        rotated = dispatch.lookup("rotary_embedding", q)(
            positions, q, k, torch.empty(9, D, device="cuda")
        )
        assert [(t.shape, t.device) for t in rotated] == [(q.shape, CUDA), (k.shape, CUDA)]


@pytest.mark.parametrize(
    "change,error",
    [
        ({"context_lens": "host"}, "context_lens on cpu"),
        ({"block_tables": "host"}, "block_tables on cpu"),
        ({"block_tables": torch.float32}, "block_tables must be int32 or int64"),
        ({"context_lens": torch.float32}, "context_lens must be int32 or int64"),
        ({"query": torch.int32}, "query must be float16, bfloat16 or float32"),
    ],
)
def test_fakes_refuse_what_a_launch_refuses(change, error) -> None:
    host = _decode_args()
    with FakeTensorMode():
        args = _on_fake_cuda(host)
        for name, how in change.items():
            shape = args[name].shape
            if how == "host":
                args[name] = torch.empty(shape, dtype=args[name].dtype)
            else:
                args[name] = torch.empty(shape, dtype=how, device="cuda")
        with pytest.raises((ValueError, TypeError), match=error):
            cuda_ops.decode_attention(*args.values(), 0.1)


def test_fakes_refuse_shapes_that_do_not_fit() -> None:
    with FakeTensorMode():
        cache = torch.empty(4, 2, KVH, BS, D, device="cuda")
        key = torch.empty(3, KVH, D, device="cuda")
        with pytest.raises(ValueError, match=r"slot_mapping must be \[num_tokens=3\]"):
            cuda_ops.write_kv_cache(
                key, key, cache, torch.empty(2, dtype=torch.long, device="cuda")
            )
        query = torch.empty(6, HEADS, D, device="cuda")
        tables = torch.empty(2, 3, dtype=torch.int32, device="cuda")
        lens = torch.empty(2, dtype=torch.int32, device="cuda")
        starts = torch.empty(2, dtype=torch.int32, device="cuda")  # one short
        with pytest.raises(ValueError, match="query_start_loc must be"):
            cuda_ops.prefill_attention(query, cache, tables, starts, lens, 0.1)
        with pytest.raises(ValueError, match="out must be like the query"):
            cuda_ops.decode_attention(query[:2], cache, tables, lens, 0.1, None, query[:2].half())
