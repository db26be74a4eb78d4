"""The device split between the engine and the torch side, at the released YuE2-3B size."""
import pytest

from yue2_vllm.memory import (GIB, ar_expert_bytes, kv_cache_bytes, nar_chunk_bytes, plan_memory, row_kv_bytes,
                              torch_decode_bytes)
from yue2_vllm.model.modeling import YuE2Config
from yue2_vllm.testing import TINY_CONFIG

FULL = YuE2Config()
MOT, AR_BF16, AR_FP8, VAE = int(6.76 * GIB), int(4.03 * GIB), int(2.92 * GIB), int(0.25 * GIB)


def test_kv_arithmetic():
    assert kv_cache_bytes(FULL) == 2.625 * GIB and kv_cache_bytes(FULL, 2) == 5.25 * GIB
    assert kv_cache_bytes(FULL, dtype_bytes=4) == 5.25 * GIB
    assert row_kv_bytes(FULL, 100, 16) == 112 * 16 * 1024 * 7  # 7 blocks of 16 tokens, 112 KiB a token
    assert ar_expert_bytes(FULL) == 2 * (2 * 184704 * 2048 + 2048 + 28 * (2 * 2048 * 2048 + 2 * 1024 * 2048
                                                                          + 3 * 6144 * 2048 + 2 * 128 + 2 * 2048))


def test_h200_split_defaults_to_many_rows_and_states_its_share():
    plan = plan_memory(FULL, device="cuda", budget_gib=80, engine_weights=AR_BF16, torch_model=MOT, vae=VAE,
                       total=int(139 * GIB))
    assert plan.problems() == [] and plan.max_num_seqs == 49
    assert plan.kv_cache == 49 * row_kv_bytes(FULL, 2048 + 9000, 16) + 2 * 16 * 112 * 1024
    assert plan.torch_decode == torch_decode_bytes(FULL, 2048 + 9000) and plan.torch_side > plan.torch_decode
    assert plan.engine == AR_BF16 + plan.kv_cache + 2 * GIB
    assert plan.gpu_memory_utilization == pytest.approx(plan.engine / (139 * GIB))
    assert plan.engine + plan.torch_side <= 80 * GIB


def test_torch_decode_counts_both_branches_kv_rows_and_one_step():
    # A CFG pair of 11,048-token rows at 112 KiB a token, plus activations and fp32 sampling rows (< 8 MiB).
    kv = 2 * 11048 * 112 * 1024
    assert kv < torch_decode_bytes(FULL, 11048) < kv + 8 * 2**20
    assert torch_decode_bytes(FULL, 11048, branches=1) < torch_decode_bytes(FULL, 11048) / 1.9


def test_24gb_card_needs_offload_and_fp8_or_is_refused_by_name():
    explicit = dict(device="cuda", budget_gib=24, torch_model=MOT, vae=VAE, total=24 * GIB, max_num_seqs=8,
                    kv_cache=8 * kv_cache_bytes(FULL))
    refused = plan_memory(FULL, engine_weights=AR_BF16, **explicit)
    (problem,) = refused.problems()
    assert "KV cache for 8 rows" in problem and "--concurrency" in problem and "--offload-ar" in problem
    with pytest.raises(MemoryError, match="the budget allows 24.00 GiB"):
        refused.check()
    fitted = plan_memory(FULL, device="cuda", budget_gib=24, engine_weights=AR_FP8, torch_model=MOT, vae=VAE,
                         total=24 * GIB, offload_ar=True)
    assert fitted.problems() == [] and 1 <= fitted.max_num_seqs < 8
    assert nar_chunk_bytes(FULL, offload_ar=True) < nar_chunk_bytes(FULL)


def test_tiny_cpu_plan_is_small():
    plan = plan_memory(TINY_CONFIG, device="cpu", budget_gib=24, engine_weights=95 * 2**20, torch_model=100 * 2**20,
                       typical_tokens=2300, total=24 * GIB)
    assert plan.max_num_seqs == 16 and plan.kv_cache < 64 * 2**20 and plan.gpu_memory_utilization is None
    assert plan.kv_cache >= row_kv_bytes(TINY_CONFIG, 24576, 128)  # any single request can be admitted


def test_vae_tile_working_set_is_the_widest_stage():
    from yue2_vllm.memory import vae_decode_bytes
    from yue2_vllm.model.vae import VAEConfig

    # Release decoder: the last stage, 64 channels x 1920 samples per frame, 4 live fp32 tensors.
    assert vae_decode_bytes(VAEConfig(), 1024, 16) == 4 * 4 * 64 * 1920 * 1056
    assert vae_decode_bytes(VAEConfig(), 512, 16) == 4 * 4 * 64 * 1920 * 544
    with pytest.raises(ValueError, match="core_frames must be >= 1"):
        vae_decode_bytes(VAEConfig(), 0, 16)


def test_total_memory_of_an_indexed_gpu(monkeypatch):
    from types import SimpleNamespace

    import torch

    from yue2_vllm.memory import total_memory_bytes

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=(i + 1) * GIB))
    assert total_memory_bytes("cuda") == GIB and total_memory_bytes("cuda:1") == 2 * GIB
