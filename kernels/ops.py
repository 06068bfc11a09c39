"""Fused element-wise ops and the linear layer used by the models, dispatched like
attention."""

from __future__ import annotations

from pdserve.kernels import dispatch, gguf_blocks, lanes, reference

rms_norm = dispatch.dispatched(reference.rms_norm_ref)
silu_and_mul = dispatch.dispatched(reference.silu_and_mul_ref)
# Picked by the query's device, the first float tensor of the call.
rotary_embedding = dispatch.dispatched(reference.rotary_embedding_ref, like=1)
# `weight` may be stored in bfloat16 while x is float32 (a bf16 model on CPU), which the
# CPU C kernel reads as is.
linear = dispatch.dispatched(reference.linear_ref)
# A bf16 weight packed with the outputs in the lanes at load (kernels/lanes.py).
linear_lanes = dispatch.dispatched(lanes.linear_lanes_ref)
# Weight-only int8: an int8 weight with one float32 scale per group of inputs of a row.
linear_int8 = dispatch.dispatched(reference.linear_int8_ref)
# GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; K-quants Q4_K, Q5_K, Q6_K) kept packed with their
# scales (kernels/gguf_blocks.py).
linear_gguf = dispatch.dispatched(gguf_blocks.linear_gguf_ref)
# Rows of such a matrix (an embedding table kept in its blocks), as float32.
gguf_rows = dispatch.dispatched(gguf_blocks.gguf_rows_ref)
