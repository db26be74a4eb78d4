"""vLLM's LoRA slots as it sizes them, at YuE2-3B's real sizes."""
from yue2_vllm.lora_memory import (ar_adapter_bytes, ar_lora_elements_per_rank, lora_slots_bytes,
                                   lora_transient_bytes, table_rows)
from yue2_vllm.model.modeling import YuE2Config
from yue2_vllm.testing import TINY_CONFIG

REAL = YuE2Config()


def test_real_sizes():
    assert ar_lora_elements_per_rank(REAL) == 1_089_536  # 38,912 per layer × 28
    assert lora_slots_bytes(REAL, 1, 64) == 139_460_608  # 133 MiB per rank-64 slot in bf16
    assert lora_slots_bytes(REAL, 1, 8) == 17_432_576
    assert lora_slots_bytes(REAL, 4, 64, dtype_bytes=4) == 4 * 2 * 139_460_608
    # the released instrumental adapter's tensor bytes (bf16 file 139,502,088 bytes with its header)
    assert ar_adapter_bytes(REAL, 64) == 139_460_608
    assert lora_slots_bytes(REAL, 0, 64) == 0 and lora_transient_bytes(0, 64, 8192) == 0
    assert lora_transient_bytes(4, 64, 8192) == 3 * 8192 * 64 * 4


def test_the_table_rows():
    rows = table_rows(REAL)
    assert [r["adapters"] for r in rows] == [0, 1, 4]
    assert [r["vllm_slots_mib"] for r in rows] == [0.0, 133.0, 532.0]
    assert rows[0]["torch_device_active_bytes"] == 0 and rows[2]["torch_host_bytes"] == 4 * 139_460_608


def test_the_count_matches_the_tiny_models_factors():
    from yue2_vllm.model.modeling import tensor_shapes

    shapes = tensor_shapes(TINY_CONFIG)
    sites = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    per_rank = sum(sum(shapes[f"model.layers.{layer}.{site}.weight"]) for layer in range(2) for site in sites)
    assert ar_lora_elements_per_rank(TINY_CONFIG) == per_rank
