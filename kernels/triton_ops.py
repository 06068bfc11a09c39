"""Registers the Triton kernels with `pdserve.kernels.dispatch`, so CUDA tensors run them,
each through its torch operator (`pdserve.kernels.cuda_ops`: the kernel on a device, a
fake implementation under `FakeTensorMode`).

Importing this module needs triton; `pdserve.kernels.dispatch` imports it on the first CUDA
lookup and falls back to the references (with the reason kept) where triton is absent.
"""

from __future__ import annotations

from pdserve.kernels import cuda_ops, dispatch

TRITON_KERNELS = {
    "write_kv_cache": cuda_ops.write_kv_cache,
    "decode_attention": cuda_ops.decode_attention,
    "prefill_attention": cuda_ops.prefill_attention,
    "rms_norm": cuda_ops.rms_norm,
    "rotary_embedding": cuda_ops.rotary_embedding,
}


def register_all() -> None:
    for name, fn in TRITON_KERNELS.items():
        dispatch.register_triton(name, fn)


register_all()
