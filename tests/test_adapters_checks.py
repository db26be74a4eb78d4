"""Bad adapters are refused before anything loads them: one line naming the file and the tensor."""
import json

import pytest
import torch
from safetensors.torch import save_file

from yue2_vllm.adapters.checks import MAX_RANK, check_adapter, max_lora_rank_for
from yue2_vllm.adapters.layouts import read_adapter
from yue2_vllm.adapters.weights import AdapterError
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.testing_adapters import REFUSED, write_tiny_adapter

Q = "layers.0.self_attn.q_proj"


def refused(path, match, max_rank=MAX_RANK):
    with pytest.raises(AdapterError) as caught:
        check_adapter(read_adapter(path, TINY_CONFIG), TINY_CONFIG, max_rank)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message, message
    assert match in message, message
    return message


def write(tmp_path, tensors, name="bad.safetensors", metadata=None):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def test_a_good_adapter_is_summarized(tmp_path):
    tiny = write_tiny_adapter(tmp_path / "a.safetensors", "comfyui", half="both", rank=4)
    summary = check_adapter(read_adapter(tiny.path, TINY_CONFIG), TINY_CONFIG)
    assert (summary.half, summary.rank, summary.ar_rank, summary.modules) == ("both", 4, 4, 30)
    assert "nar_self_attn.q_proj" in summary.projections and "vae2llm" in summary.projections


@pytest.mark.parametrize("tensors, match", [
    ({f"{Q}.lora_A": torch.ones(4, 100), f"{Q}.lora_B": torch.ones(128, 4)},
     f"tensor {Q}.lora_A: shape [4, 100], model.layers.0.self_attn.q_proj needs lora_A [rank, 128]"),
    ({"layers.0.self_attn.k_proj.lora_A": torch.ones(4, 128), "layers.0.self_attn.k_proj.lora_B": torch.ones(128, 4)},
     "tensor layers.0.self_attn.k_proj.lora_B: shape [128, 4], model.layers.0.self_attn.k_proj needs lora_B [64, 4]"),
    ({f"{Q}.lora_A": torch.ones(4, 128), f"{Q}.lora_B": torch.ones(128, 3)}, "are not a [rank, in] / [out, rank] pair"),
    ({f"{Q}.lora_A": torch.ones(4, 128)}, f"tensor {Q}.lora_A: model.layers.0.self_attn.q_proj has no lora_B"),
    ({f"{Q}.lora_B": torch.ones(128, 4)}, "has no lora_A (missing key)"),
    ({"layers.5.self_attn.q_proj.lora_A": torch.ones(4, 128), "layers.5.self_attn.q_proj.lora_B": torch.ones(128, 4)},
     "the base model has no model.layers.5.self_attn.q_proj (unknown key)"),
    ({"layers.0.self_attn.zz_proj.lora_A": torch.ones(4, 128)}, "tensor layers.0.self_attn.zz_proj.lora_A: unknown key"),
    ({f"{Q}.lora_A": torch.ones(4, 128), f"{Q}.lora_B": torch.full((128, 4), float("nan"))},
     f"tensor {Q}.lora_B: holds non-finite values"),
    ({f"{Q}.lora_A": torch.ones(4, 128), f"{Q}.lora_B": torch.ones(128, 4, dtype=torch.int32)}, "is not a float type"),
    ({"text_encoders.model.layers.0.mlp.down_proj.diff": torch.ones(128, 256)},
     "a full-rank delta on the AR half (vLLM runs AR adapters as LoRA pairs only)"),
    ({"diffusion_model.model.layers.0.mlp.down_proj.diff_b": torch.ones(128)}, "has no bias"),
    ({"vae2llm.weight": torch.ones(128, 32)}, "tensor vae2llm.weight: shape [128, 32], vae2llm.weight is [128, 64]"),
    ({f"{Q}.lora_A": torch.ones(4, 128), f"{Q}.lora_B": torch.ones(128, 4), f"{Q}.alpha": torch.ones(2)},
     "an alpha must hold one number"),
    ({f"{Q}.lora_A": torch.ones(4, 128), f"base_model.model.model.{Q}.lora_A.weight": torch.ones(4, 128),
      f"{Q}.lora_B": torch.ones(128, 4)}, "is given twice"),
])
def test_bad_tensors_are_named(tmp_path, tensors, match):
    refused(write(tmp_path, tensors), match)


def test_a_rank_above_the_limit(tmp_path):
    tiny = write_tiny_adapter(tmp_path / "a.safetensors", "plain", rank=16)
    refused(tiny.path, "rank 16 is above the limit 8", max_rank=8)
    assert max_lora_rank_for(16) == 16 and max_lora_rank_for(17) == 32 and max_lora_rank_for(2) == 8
    assert max_lora_rank_for(300) == 320
    with pytest.raises(ValueError, match="above vLLM's largest max_lora_rank 512"):
        max_lora_rank_for(513)


def test_mixed_ranks_where_the_config_forbids_them(tmp_path):
    tiny = write_tiny_adapter(tmp_path / "a", "alpha-rank", rank=4)
    (tiny.path / "adapter_config.json").write_text(json.dumps({"alpha": 8, "rank": 8}))
    refused(tiny.path, "declares rank 8 (mixed ranks)")


@pytest.mark.parametrize("layout, match", [
    ("lokr", "a LoKr factor"), ("dora", "DoRA (use_dora)"), ("particles", "routed-particle slider"),
    ("lm_head", "tensor lm_head.lora_A: LoRA on the embeddings or the lm_head"),
])
def test_layouts_that_are_not_lora_are_refused_by_name(tmp_path, layout, match):
    path = tmp_path / (layout if layout == "dora" else f"{layout}.safetensors")
    assert layout in REFUSED
    write_tiny_adapter(path, layout)
    refused(path, match)


@pytest.mark.parametrize("config, match", [
    ({"peft_type": "LOHA", "r": 4}, "peft_type 'LOHA' is not LoRA"),
    ({"r": 4, "lora_alpha": 8, "bias": "all"}, "adapter bias"),
    ({"r": 4, "lora_alpha": 8, "init_lora_weights": "pissa"}, "changes the base weights"),
    ({"r": 0, "lora_alpha": 8}, "r must be a positive integer"),
    ({"r": 4, "lora_alpha": "x"}, "lora_alpha 'x' is not a number"),
    ({"target_modules": ["q_proj"]}, "holds neither PEFT's r / lora_alpha nor alpha / rank"),
])
def test_bad_configs_are_named(tmp_path, config, match):
    tiny = write_tiny_adapter(tmp_path / "a", "peft")
    (tiny.path / "adapter_config.json").write_text(json.dumps(config))
    refused(tiny.path, match)


def test_an_empty_file_is_refused(tmp_path):
    refused(write(tmp_path, {}), "holds no tensors")
