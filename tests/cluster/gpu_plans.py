"""GPU placements of one prefill and one decode instance, written out by hand: the GPUs
each instance sees (its CUDA_VISIBLE_DEVICES under the local launcher, one per rank), or
the one-line refusal when the ranks cannot each have a GPU of their own."""

from __future__ import annotations

import json
from pathlib import Path

# (GPUs on the node, TP, PP) → (prefill-0's GPUs, decode-0's GPUs): every plan that fits.
# Single-rank instances share a GPU, as they always did.
PLACED: dict[tuple[int, int, int], tuple[str, str]] = {
    (1, 1, 1): ("0", "0"),
    (2, 1, 1): ("0", "1"),
    (8, 1, 1): ("0", "1"),
    (8, 2, 1): ("0,1", "2,3"),
    (8, 1, 2): ("0,1", "2,3"),
    (8, 4, 1): ("0,1,2,3", "4,5,6,7"),
    (8, 2, 2): ("0,1,2,3", "4,5,6,7"),
}
# Every plan on 1, 2 or 8 GPUs with TP 1, 2 or 4 and PP 1 or 2: (GPUs on the node, TP, PP,
# the placement, or what the refusal says: two instances of TP x PP ranks need as many
# GPUs of their own).
PLANS: list[tuple[int, int, int, tuple[str, str] | str]] = [
    (gpus, tp, pp, PLACED.get((gpus, tp, pp), f"need {2 * tp * pp} GPUs"))
    for gpus in (1, 2, 8)
    for pp in (1, 2)
    for tp in (1, 2, 4)
]


def plan_id(plan: tuple) -> str:
    gpus, tp, pp, _ = plan
    return f"{gpus}gpu-tp{tp}-pp{pp}"


def write_split_model(folder: Path) -> str:
    """A config.json that splits over 1, 2 or 4 TP ranks and 1 or 2 stages (placement
    reads no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "vocab_size": 128, "max_position_embeddings": 256,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
