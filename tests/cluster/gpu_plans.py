"""GPU placements of one prefill and one decode instance, written out by hand: the GPUs
each instance sees (its CUDA_VISIBLE_DEVICES under the local launcher, one per rank), or
the one-line refusal when the ranks cannot each have a GPU of their own."""

from __future__ import annotations

import json
from pathlib import Path

# (GPUs on the node, TP, PP, (prefill-0's GPUs, decode-0's GPUs) or what the refusal says)
PLANS: list[tuple[int, int, int, tuple[str, str] | str]] = [
    (1, 1, 1, ("0", "0")),  # single-rank instances share a GPU, as they always did
    (1, 2, 1, "need 4 GPUs"),
    (1, 1, 2, "need 4 GPUs"),
    (1, 4, 1, "need 8 GPUs"),
    (1, 2, 2, "need 8 GPUs"),
    (1, 4, 2, "need 16 GPUs"),
    (2, 1, 1, ("0", "1")),
    (2, 2, 1, "need 4 GPUs"),
    (2, 1, 2, "need 4 GPUs"),
    (2, 4, 1, "need 8 GPUs"),
    (2, 2, 2, "need 8 GPUs"),
    (2, 4, 2, "need 16 GPUs"),
    (8, 1, 1, ("0", "1")),
    (8, 2, 1, ("0,1", "2,3")),
    (8, 1, 2, ("0,1", "2,3")),
    (8, 4, 1, ("0,1,2,3", "4,5,6,7")),
    (8, 2, 2, ("0,1,2,3", "4,5,6,7")),
    (8, 4, 2, "need 16 GPUs"),
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
