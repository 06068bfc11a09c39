"""Registers the Triton kernels with `pdserve.kernels.dispatch`, so CUDA tensors run them.

Importing this module needs triton; `pdserve.kernels.dispatch` imports it on the first CUDA
lookup and falls back to the references (with the reason kept) where triton is absent.
"""

from __future__ import annotations

from pdserve.kernels import dispatch
from pdserve.kernels.triton_decode import decode_attention_triton
from pdserve.kernels.triton_kv_write import write_kv_cache_triton
from pdserve.kernels.triton_norm import rms_norm_triton
from pdserve.kernels.triton_prefill import prefill_attention_triton
from pdserve.kernels.triton_rotary import rotary_embedding_triton

TRITON_KERNELS = {
    "write_kv_cache": write_kv_cache_triton,
    "decode_attention": decode_attention_triton,
    "prefill_attention": prefill_attention_triton,
    "rms_norm": rms_norm_triton,
    "rotary_embedding": rotary_embedding_triton,
}


def register_all() -> None:
    for name, fn in TRITON_KERNELS.items():
        dispatch.register_triton(name, fn)


register_all()
