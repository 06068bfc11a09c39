"""How a model splits across ranks: the one rule `serve`, the executor, `pdserve plan`
(tested against it) and `kvtransfer` share. Pure arithmetic on the model's shape, so the
torch-free rooms check it too."""

from __future__ import annotations


class TensorParallelError(ValueError):
    """A TP size the model's shape cannot be split by."""


class PipelineParallelError(ValueError):
    """A PP size the model's layers cannot be split by."""


class Int8GroupError(ValueError):
    """int8 scale groups that a weight row (or a rank's slice of one) cannot hold whole."""


def check_tp_size(
    tp_size: int,
    num_heads: int | None,
    num_kv_heads: int,
    intermediate_size: int | None = None,
) -> None:
    """Whole KV heads (so whole GQA groups), query heads and MLP rows per rank; no KV head
    is replicated. `num_heads`/`intermediate_size` None: only what the caller knows (a KV
    layout knows its KV heads)."""
    if tp_size < 1:
        raise TensorParallelError(f"tensor parallel size must be at least 1, got {tp_size}")
    heads = num_kv_heads if num_heads is None else num_heads
    if num_kv_heads % tp_size or heads % tp_size:
        known = "" if num_heads is None else f" and {num_heads} attention heads"
        raise TensorParallelError(
            f"tensor parallel size {tp_size} does not divide the model's {num_kv_heads} KV "
            f"heads{known} (use a divisor of {num_kv_heads})"
        )
    if intermediate_size is not None and intermediate_size % tp_size:
        raise TensorParallelError(
            f"tensor parallel size {tp_size} does not divide the MLP's intermediate size "
            f"{intermediate_size}"
        )


# `--quantization int8`: inputs per scale of a weight row (engine/models/int8.py).
INT8_GROUP_SIZE = 16


def check_int8_groups(
    tp_size: int,
    hidden_size: int,
    attention_width: int,
    intermediate_size: int,
    group_size: int = INT8_GROUP_SIZE,
) -> None:
    """Every int8 matrix's rows split into whole scale groups on every rank: the input
    widths of QKV and gate/up (hidden), and each rank's slice of the row-parallel ones'
    (attention output: heads x head_dim; down: the MLP width), so no group spans two
    ranks."""
    widths = (
        ("hidden size", hidden_size, hidden_size),
        ("attention output's input width", attention_width, attention_width // tp_size),
        ("MLP's intermediate size", intermediate_size, intermediate_size // tp_size),
    )
    for what, total, per_rank in widths:
        if per_rank % group_size:
            split = f" / tensor parallel size {tp_size} = {per_rank}" if tp_size > 1 else ""
            raise Int8GroupError(
                f"--quantization int8 keeps one scale per {group_size} inputs, which does not "
                f"divide the model's {what} {total}{split}"
            )


def check_pp_size(pp_size: int, num_layers: int) -> None:
    """Every pipeline stage holds at least one layer."""
    if pp_size < 1:
        raise PipelineParallelError(f"pipeline parallel size must be at least 1, got {pp_size}")
    if pp_size > num_layers:
        raise PipelineParallelError(
            f"pipeline parallel size {pp_size} exceeds the model's {num_layers} layers "
            f"(use at most {num_layers})"
        )


def stage_layers(num_layers: int, pp_size: int, stage: int) -> tuple[int, int]:
    """Stage `stage`'s contiguous layers [start, stop): an even split, the first
    `num_layers % pp_size` stages one layer more (the last one also runs the LM head)."""
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)
