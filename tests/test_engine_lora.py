"""The engine's LoRA settings, adapter ids, the directory check, and the mixed-batch guard's arithmetic."""
import json

import pytest
import torch

from yue2_vllm.engine.lora import (GUARDED, LoraIds, LoraSettings, TARGET_MODULES, check_peft_directory,
                                   needs_mixed_batch_guard)


def test_settings():
    assert LoraSettings().engine_args() == {} and not LoraSettings().enabled
    args = LoraSettings(max_loras=4, max_lora_rank=64).engine_args()
    assert args == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 64, "max_cpu_loras": 4,
                    "lora_target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
    assert LoraSettings(2, 8, max_cpu_loras=1).engine_args()["max_cpu_loras"] == 2
    assert LoraSettings(1, 8).record()["target_modules"] == list(TARGET_MODULES)


def test_ids_are_stable_per_content_and_scale():
    ids = LoraIds()
    one = ids.slot("a" * 64, 1.0, "/x")
    assert ids.slot("a" * 64, 1, "/x") == one and one.int_id == 1
    assert ids.slot("a" * 64, 0.5, "/y").int_id == 2 and ids.slot("b" * 64, 1.0, "/z").int_id == 3
    assert one.name == "aaaaaaaaaaaaaaaa@1.0" and one.to_dict()["path"] == "/x"


def test_the_directory_check(tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json is not readable"):
        check_peft_directory(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"alpha": 8, "rank": 8}))
    with pytest.raises(ValueError, match="lacks r, lora_alpha, target_modules"):
        check_peft_directory(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "target_modules": ["lm_head"]}))
    with pytest.raises(ValueError, match="beyond the AR projections"):
        check_peft_directory(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        check_peft_directory(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    check_peft_directory(tmp_path)


def test_which_releases_need_the_guard():
    assert needs_mixed_batch_guard("0.32.0", "cpu") and needs_mixed_batch_guard("0.31.2+cpu", "cpu")
    assert not needs_mixed_batch_guard("0.33.0", "cpu") and not needs_mixed_batch_guard("0.32.0", "cuda")


def test_the_guarded_ops_leave_rows_without_an_adapter_alone():
    g = torch.Generator().manual_seed(0)
    slots, rank, width, out = 2, 4, 8, 6
    a = torch.randn(slots, 1, rank, width, generator=g)
    b = torch.randn(slots, 1, out, rank, generator=g)
    x = torch.randn(3, width, generator=g)
    indices = torch.tensor([0, -1, 1])
    shrunk = torch.zeros(3, rank)
    GUARDED["bgmv_shrink"](x, a, shrunk, indices, 0.5)
    assert torch.equal(shrunk[1], torch.zeros(rank))
    torch.testing.assert_close(shrunk[0], 0.5 * a[0, 0] @ x[0])
    torch.testing.assert_close(shrunk[2], 0.5 * a[1, 0] @ x[2])
    base = torch.randn(3, out, generator=g)
    added = base.clone()
    GUARDED["bgmv_expand"](shrunk, b, added, indices, True)
    assert torch.equal(added[1], base[1])
    torch.testing.assert_close(added[2], base[2] + b[1, 0] @ shrunk[2])
    replaced = base.clone()
    GUARDED["bgmv_expand"](shrunk, b, replaced, indices, False)
    assert torch.equal(replaced[1], base[1]) and torch.allclose(replaced[0], b[0, 0] @ shrunk[0])
    wide = torch.zeros(3, out + 4)
    GUARDED["bgmv_expand_slice"](shrunk, b, wide, indices, 2, out, True)
    assert torch.equal(wide[1], torch.zeros(out + 4)) and torch.equal(wide[:, :2], torch.zeros(3, 2))
    torch.testing.assert_close(wide[0, 2:2 + out], b[0, 0] @ shrunk[0])
