"""`pdserve serve`'s flags for the precision of the weights and of the KV cache."""

from __future__ import annotations

import argparse

from pdserve.engine.config import DTYPES, KV_CACHE_DTYPES

DTYPE_CHOICES = ("auto", *DTYPES)


def add_precision_flags(model: argparse._ArgumentGroup) -> None:
    model.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    # Checked by EngineConfig (one line naming the choices), not by argparse's choices.
    model.add_argument(
        "--quantization",
        "-q",
        default=None,
        metavar="METHOD",
        help="quantize the weights at load: int8 (the decoder layers' matrices as int8 with "
        "one scale per 16 inputs, CPU; docs/quantization.md) (default: none)",
    )
    model.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV cache's dtype: auto (the model's), or FP8, one byte an element with "
        "one scale per layer's keys and values (fp8 = fp8_e4m3; CPU; docs/quantization.md)",
    )
    model.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="an FP8 KV cache's scales measured at load on a calibration text, not read "
        "from the checkpoint (which else gives them, or 1.0); needs --kv-cache-dtype fp8",
    )
