"""Planner formulas against hand-worked examples."""

from __future__ import annotations

import json
import struct

import pytest

from pdserve.planner.capacity import (
    LoadProfile,
    PhaseThroughput,
    max_utilization_for_ttft,
    mdl_mean_wait,
    plan_capacity,
    throughput_from_sweep,
)
from pdserve.planner.cost import CostInputs, plan_cost, price_per_million_tokens
from pdserve.planner.memory import (
    GIB,
    MemoryInputs,
    kv_bytes_per_token,
    plan_memory,
    valid_tp_sizes,
    weight_bytes,
)
from pdserve.planner.model_config import ModelShape, checkpoint_parameter_count, load_config

KIB = 1024

LLAMA3_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
LLAMA3_70B = {
    **LLAMA3_8B,
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "intermediate_size": 28672,
}
SMOLLM2_135M = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
MIXTRAL_8X7B = {
    **LLAMA3_8B,
    "model_type": "mixtral",
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def shape_with(layers: int, kv_heads: int = 8, head_dim: int = 128) -> ModelShape:
    return ModelShape.from_config(
        {
            "num_hidden_layers": layers,
            "hidden_size": 5120,
            "num_attention_heads": 40,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "intermediate_size": 27648,
            "vocab_size": 152064,
        }
    )


def test_kv_bytes_per_token_matches_the_worked_examples() -> None:
    # 2 x 64 layers x 8 heads x 128 dims x 2 bytes = 262144 B = 256 KiB.
    assert kv_bytes_per_token(shape_with(64), "bfloat16") == 256 * KIB
    # 2 x 80 x 8 x 128 x 2 = 327680 B = 320 KiB.
    assert kv_bytes_per_token(ModelShape.from_config(LLAMA3_70B), "bfloat16") == 320 * KIB
    assert kv_bytes_per_token(shape_with(64), "fp8") == 128 * KIB
    # Tensor parallelism splits the KV heads; serve refuses more ranks than KV heads
    # (no replicated heads), and so does the planner.
    assert kv_bytes_per_token(shape_with(64), "bfloat16", tp=4) == 64 * KIB
    with pytest.raises(ValueError, match="does not divide"):
        kv_bytes_per_token(shape_with(64), "bfloat16", tp=16)
    with pytest.raises(ValueError, match="does not divide"):
        kv_bytes_per_token(shape_with(64, kv_heads=6), "bfloat16", tp=4)


def test_parameter_counts_of_known_models() -> None:
    assert ModelShape.from_config(SMOLLM2_135M).parameter_count().total == 134_515_008
    llama8b = ModelShape.from_config(LLAMA3_8B).parameter_count()
    assert llama8b.total == 8_030_261_248
    # 32 layers x (41,943,040 attention + 176,160,768 MLP) projection weights.
    assert llama8b.linear == 6_979_321_856
    assert ModelShape.from_config(LLAMA3_70B).parameter_count().total == 70_553_706_496
    assert ModelShape.from_config(MIXTRAL_8X7B).parameter_count().total == 46_702_792_704
    # Qwen2's q/k/v biases: 28 layers x (3584 + 2 x 512) more than without.
    qwen = {
        **LLAMA3_8B,
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
    }
    plain = ModelShape.from_config(qwen).parameter_count().total
    biased = ModelShape.from_config({**qwen, "model_type": "qwen2"}).parameter_count().total
    assert biased - plain == 28 * (3584 + 2 * 512)


def test_weight_bytes_by_dtype() -> None:
    shape = ModelShape.from_config(LLAMA3_8B)
    assert weight_bytes(shape, "bfloat16") == 2 * 8_030_261_248
    assert weight_bytes(shape, "fp8") == 6_979_321_856 * 1 + 1_050_939_392 * 2
    # INT4: 0.5 B per weight plus a 4-byte scale/zero pair per group of 128.
    assert weight_bytes(shape, "int4") == 6_979_321_856 * (0.5 + 4 / 128) + 1_050_939_392 * 2
    assert weight_bytes(shape, "int4") == 5_809_643_520
    # INT8 as `--quantization int8` stores it: 1 B per weight plus a float32 scale per 16.
    assert weight_bytes(shape, "int8") == 6_979_321_856 * (1 + 4 / 16) + 1_050_939_392 * 2
    assert weight_bytes(shape, "int8") == 10_826_031_104


def test_int8_weights_offer_only_the_tp_sizes_whose_slices_hold_whole_groups() -> None:
    """An MLP of 14368 = 898 x 16 rows: at TP 4 a rank's 3592 columns of the down
    projection would cut a group of 16, so int8 stops at TP 2 where bfloat16 goes to 8."""
    from pdserve.common.model_split import Int8GroupError, check_int8_groups

    shape = ModelShape.from_config({**LLAMA3_8B, "intermediate_size": 14368})
    assert valid_tp_sizes(shape, "bfloat16") == [1, 2, 4, 8]
    assert valid_tp_sizes(shape, "int8") == [1, 2]
    plan = plan_memory(shape, MemoryInputs(dtype="int8"))
    assert [m["tp"] for m in plan["per_tp"]] == [1, 2]
    for tp in (1, 2, 4, 8):
        width = shape.num_attention_heads * shape.head_dim
        try:
            check_int8_groups(tp, shape.hidden_size, width, shape.intermediate_size)
        except Int8GroupError:
            assert tp not in valid_tp_sizes(shape, "int8")
        else:
            assert tp in valid_tp_sizes(shape, "int8")


def test_memory_plan_finds_the_tensor_parallelism_needed() -> None:
    shape = ModelShape.from_config(LLAMA3_70B)
    inputs = MemoryInputs(max_model_len=8192, max_num_seqs=32, gpu_memory_gib=80.0)
    plan = plan_memory(shape, inputs)
    assert plan["weights_gib"] == pytest.approx(70_553_706_496 * 2 / GIB)
    # Only what serve can run: sizes dividing the 8 KV heads, 64 heads and the MLP.
    assert [m["tp"] for m in plan["per_tp"]] == [1, 2, 4, 8]
    # 131 GiB of weights cannot sit on one 80 GiB GPU; on two there is room for one
    # 8192-token sequence (1.25 GiB of KV per GPU) but not 32 of them (40 GiB).
    assert plan["tp_needed_for_one_sequence"] == 2
    assert plan["tp_needed_for_max_num_seqs"] == 4
    tp4 = plan["per_tp"][2]
    assert tp4["kv_needed_gib"] == pytest.approx(80 * KIB * 8192 * 32 / GIB)
    assert tp4["usable_gib"] == pytest.approx(72.0)
    low, high = tp4["kv_capacity_tokens"]
    assert low < high
    assert low == int(
        (72.0 * GIB - tp4["weights_gib"] * GIB - tp4["overhead_gib"][1] * GIB) // (80 * KIB)
    )


def test_capacity_from_a_load_profile() -> None:
    load = LoadProfile(
        requests_per_minute=600, prompt_tokens=2000, output_tokens=200, ttft_slo_ms=500
    )
    plan = plan_capacity(load, PhaseThroughput(10_000, 1_000), [0.7, 0.65])
    assert plan["input_tokens_per_s"] == 20_000 and plan["output_tokens_per_s"] == 2_000
    assert plan["prefill_gpus_at_full_load"] == 2.0 and plan["decode_gpus_at_full_load"] == 2.0
    at70, at65 = plan["at_target_utilization"]
    assert (at70["prefill_instances"], at70["decode_instances"], at70["colocated_gpus"]) == (
        3,
        3,
        6,
    )
    assert (at65["prefill_instances"], at65["decode_instances"], at65["colocated_gpus"]) == (
        4,
        4,
        7,
    )
    # Prefill of 2000 tokens at 10k tok/s takes 200 ms; three instances at 10/3 req/s
    # each run at rho = 2/3, so the M/D/1 wait is (2/3 * 0.2) / (2 * 1/3) = 200 ms.
    assert at70["prefill_mean_ttft_ms"] == pytest.approx(400.0)
    assert plan["prefill_max_utilization_for_ttft"] == pytest.approx(0.75)


def test_queueing_formulas() -> None:
    assert mdl_mean_wait(0.1, 0.5) == pytest.approx(0.05)
    assert max_utilization_for_ttft(0.2, 0.5) == pytest.approx(0.75)
    assert max_utilization_for_ttft(0.6, 0.5) == 0.0


def test_cost_per_million_tokens_and_break_even() -> None:
    # $2/h over 1000 tok/s: 2/3600 $/s * 1e6 / 1000 = $0.5556 per 1M tokens.
    assert price_per_million_tokens(2.0, 1000.0) == pytest.approx(0.5555555)
    costs = CostInputs(gpu_hourly_price=2.0, api_input_price=0.5, api_output_price=1.5)
    cost = plan_cost(
        costs, gpus=2, prefill_gpu_share=0.5, input_tokens_per_s=1000, output_tokens_per_s=250
    )
    assert cost["price_per_1m_tokens"] == pytest.approx(4 / 3600 * 1e6 / 1250)
    assert cost["price_per_1m_input_tokens"] == pytest.approx(4 / 3600 * 0.5 * 1e6 / 1000)
    assert cost["price_per_1m_output_tokens"] == pytest.approx(4 / 3600 * 0.5 * 1e6 / 250)
    assert cost["cost_per_year"] == pytest.approx(4 * 24 * 365)
    assert cost["by_daily_utilization"][2] == {
        "utilization": 0.5,
        "price_per_1m_tokens": pytest.approx(2 * cost["price_per_1m_tokens"]),
    }
    # The API would charge 1000 * 0.5e-6 + 250 * 1.5e-6 = $0.000875/s at peak; the GPUs
    # cost $0.001111/s, so the API is cheaper even at full load.
    assert cost["api"]["break_even_utilization"] == pytest.approx((4 / 3600) / 0.000875)
    assert cost["api"]["self_hosting_cheaper_at_peak"] is False
    with pytest.raises(ValueError, match="both"):
        plan_cost(CostInputs(2.0, api_input_price=1.0), 1, 0.5, 1.0, 1.0)


def test_throughputs_from_a_sweep_result() -> None:
    sweep = {
        "capacity": {
            "prefill_tokens_per_s_per_gpu": 5000.0,
            "decode_tokens_per_s_per_gpu": 700.0,
            "method": "prefill probe",
        }
    }
    assert throughput_from_sweep(sweep) == PhaseThroughput(5000.0, 700.0, "sweep: prefill probe")
    with pytest.raises(ValueError, match="no working point"):
        throughput_from_sweep({"capacity": None})


def test_config_and_checkpoint_reading(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    header = json.dumps(
        {
            "a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
            "b": {"dtype": "BF16", "shape": [5], "data_offsets": [24, 34]},
        }
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + b"\0" * 34
    )
    assert ModelShape.from_config(load_config(str(tmp_path))).num_kv_heads == 3
    assert checkpoint_parameter_count(str(tmp_path)) == 17
    with pytest.raises(ValueError, match="no config.json"):
        load_config(str(tmp_path / "missing"))


def test_the_planner_offers_exactly_the_tp_sizes_serve_accepts() -> None:
    from pdserve.common.model_split import TensorParallelError, check_tp_size
    from pdserve.planner.memory import TP_CANDIDATES, valid_tp_sizes

    for config in (LLAMA3_70B, LLAMA3_8B, SMOLLM2_135M):
        shape = ModelShape.from_config(config)
        accepted = []
        for tp in TP_CANDIDATES:
            try:
                check_tp_size(
                    tp, shape.num_attention_heads, shape.num_kv_heads, shape.intermediate_size
                )
                accepted.append(tp)
            except TensorParallelError:
                pass
        assert valid_tp_sizes(shape) == accepted
