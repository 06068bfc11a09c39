"""Ranks per instance of each pool (`--tensor-parallel-size`, the per-pool overrides,
`--pipeline-parallel-size`), checked against the model they will serve."""

from __future__ import annotations

import argparse

from pdserve.common.model_split import (
    Int8GroupError,
    PipelineParallelError,
    TensorParallelError,
    check_int8_groups,
    check_pp_size,
    check_tp_size,
)
from pdserve.engine.checkpoint import CheckpointError


class ParallelSizeError(ValueError):
    """A parallel size the model cannot be split by, in one line naming the flag."""


def tensor_parallel_sizes(
    args: argparse.Namespace, model_path: str | None, device: str
) -> dict[str, int]:
    """Ranks per stage by role, checked against the model's heads (one rule:
    `common.model_split.check_tp_size`; with int8 weights, `check_int8_groups` too), and
    the pipeline size against its layers (`check_pp_size`)."""
    default = args.tensor_parallel_size
    sizes = {
        "prefill": args.prefill_tensor_parallel_size or default,
        "decode": args.decode_tensor_parallel_size or default,
        "colocated": default,
    }
    if set(sizes.values()) == {1} and args.pipeline_parallel_size == 1:
        return sizes
    from pdserve.engine.checkpoint import load_model_config
    from pdserve.engine.embedded import served_model_path
    from pdserve.engine.gguf_prepare import check_tp_blocks

    # With no model, the embedded model's files as its instances will serve them.
    model = model_path or served_model_path(device, args.dtype, args.quantization)
    try:
        mc = load_model_config(model)
    except CheckpointError as exc:
        raise ParallelSizeError(str(exc)) from None
    try:  # one PP size for every pool: a stage's layers move to the same stage
        check_pp_size(args.pipeline_parallel_size, mc.num_hidden_layers)
    except PipelineParallelError as exc:
        raise ParallelSizeError(f"--pipeline-parallel-size: {exc}") from None
    for role, size in sizes.items():
        try:
            check_tp_size(
                size, mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size
            )
            if args.quantization == "int8":  # each rank's slice holds whole scale groups
                check_int8_groups(
                    size,
                    mc.hidden_size,
                    mc.num_attention_heads * mc.head_dim,
                    mc.intermediate_size,
                )
        except (TensorParallelError, Int8GroupError) as exc:
            # Name the flag that set the size: the role's own when given, else the shared one.
            own = getattr(args, f"{role}_tensor_parallel_size", None)
            flag = f"--{role + '-' if own else ''}tensor-parallel-size"
            raise ParallelSizeError(f"{flag}: {exc}") from None
        try:  # a GGUF's row-parallel matrices split on whole blocks
            check_tp_blocks(model, size)
        except CheckpointError as exc:
            raise ParallelSizeError(str(exc)) from None
    return sizes
