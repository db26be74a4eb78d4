"""What adapters cost in memory, at any model size: vLLM's LoRA slots as it sizes them, and adapters' own bytes.

vLLM allocates its LoRA buffers when the model loads (before the KV cache is sized, so they count as model
memory), per wrapped layer, for `max_loras` slots, padded to `max_lora_rank` R, in `lora_dtype` (the model's
dtype): A `[max_loras, 1, R, in]` and B `[max_loras, 1, out, R]` per slice (q/k/v slices of the packed
qkv_proj, gate/up of gate_up_proj; lora/layers/base_linear.py, column_parallel_linear.py). With our target
modules (the 7 AR projections, not the embeddings or the lm_head) that is R·(7h + 2q + 2kv + 3i) elements per
layer and slot: 38,912·R at YuE2-3B's sizes, 1,089,536·R for its 28 layers (133 MiB per rank-64 slot in bf16).
An adapter's own LoRA pairs on those projections hold the same count at its own rank.
"""
from __future__ import annotations

from .model.modeling import YuE2Config

MIB = 2**20


def ar_lora_elements_per_rank(config: YuE2Config) -> int:
    """Elements of A and B over the 7 AR projections of every layer, per unit of rank."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return config.num_hidden_layers * (7 * h + 2 * q + 2 * kv + 3 * i)


def lora_slots_bytes(config: YuE2Config, max_loras: int, max_lora_rank: int, dtype_bytes: int = 2) -> int:
    """vLLM's LoRA buffers for `max_loras` slots of rank `max_lora_rank` (0 when LoRA is off)."""
    return max_loras * max_lora_rank * ar_lora_elements_per_rank(config) * dtype_bytes


def lora_transient_bytes(max_loras: int, max_lora_rank: int, max_num_batched_tokens: int) -> int:
    """The punica wrapper's float32 shrink buffer, `[tokens, R]` per slice (3 for the packed qkv), at most."""
    return 0 if not max_loras else 3 * max_num_batched_tokens * max_lora_rank * 4


def ar_adapter_bytes(config: YuE2Config, rank: int, dtype_bytes: int = 2) -> int:
    """An AR adapter of `rank` on all 7 projections of every layer (e.g. the released rank-64 instrumental one:
    139,460,608 bytes in bf16)."""
    return rank * ar_lora_elements_per_rank(config) * dtype_bytes


def table_rows(config: YuE2Config, counts=(0, 1, 4), rank: int = 64, dtype_bytes: int = 2) -> list[dict]:
    """The memory table's adapter rows: vLLM's slots for 0 / 1 / 4 adapters of `rank` (what `max_loras` = count
    reserves), and the torch side's copy of their AR factors (the NAR prefill and the torch AR backend apply
    them; on the device, in the model's dtype, while a song applies one)."""
    rows = []
    for count in counts:
        slots = lora_slots_bytes(config, count, rank, dtype_bytes)
        rows.append({"adapters": count, "rank": rank if count else 0, "vllm_slots_bytes": slots,
                     "vllm_slots_mib": round(slots / MIB, 1),
                     "torch_host_bytes": count * ar_adapter_bytes(config, rank, dtype_bytes),
                     "torch_device_active_bytes": ar_adapter_bytes(config, rank, dtype_bytes) if count else 0})
    return rows
