"""The tiny adapters carry each layout's real key names; the merged model is W + s·BA."""
import json

import pytest
import torch
from safetensors import safe_open

from yue2_vllm.testing import write_tiny_model
from yue2_vllm.testing_adapters import LAYOUTS, write_merged_model, write_tiny_adapter


def keys(path):
    with safe_open(str(path), "pt") as handle:
        return set(handle.keys()), handle.metadata()


@pytest.mark.parametrize("layout, target, example", [
    ("plain", "a.safetensors", "layers.1.self_attn.q_proj.lora_A"),
    ("peft", "a/adapter_model.safetensors", "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"),
    ("alpha-rank", "a/lora.safetensors", "model.layers.0.self_attn.o_proj.lora_A"),
    ("comfyui", "a.safetensors", "text_encoders.model.layers.1.self_attn.qkv_proj.lora_up.weight"),
    ("lora.json", "a/a.safetensors", "text_encoders.model.layers.0.mlp.gate_up_proj.lora_down.weight"),
    ("slider-distill", "a.safetensors", "adapters.model-layers-1-self_attn-v_proj.lora_down.weight"),
])
def test_real_key_names(tmp_path, layout, target, example):
    write_tiny_adapter(tmp_path / target.split("/")[0], layout)
    found, metadata = keys(tmp_path / target)
    assert example in found
    if layout == "slider-distill":
        assert json.loads(metadata["conceptmod"])["format"] == "conceptmod-yue2-ar-v1"
    assert set(LAYOUTS) >= {layout}


def test_nar_extras(tmp_path):
    found, _ = keys(write_tiny_adapter(tmp_path / "n.safetensors", "plain", half="nar").path)
    assert {"vae2llm.weight", "vae2llm.bias", "llm2vae.weight", "layers.0.nar_mlp.up_proj.lora_B"} <= found
    found, _ = keys(write_tiny_adapter(tmp_path / "c.safetensors", "comfyui", half="nar").path)
    assert {"diffusion_model.vae2llm.diff", "diffusion_model.model.layers.0.self_attn.qkv_proj.lora_A.weight"} <= found


def test_a_merged_model_is_w_plus_s_ba(tmp_path):
    from safetensors.torch import load_file

    model = write_tiny_model(tmp_path / "m")
    tiny = write_tiny_adapter(tmp_path / "a.safetensors", "plain", rank=4)
    merged = write_merged_model(model, tmp_path / "merged", tiny.scaled(0.5))
    base, out = load_file(str(model / "model.safetensors")), load_file(str(merged / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"
    edit = tiny.edits[name][0]
    assert out[f"{name}.weight"].dtype == torch.float32
    assert torch.equal(out[f"{name}.weight"], base[f"{name}.weight"].float() + 0.5 * (edit.b @ edit.a))
    assert torch.equal(out["model.norm.weight"], base["model.norm.weight"])
    assert (merged / "qwen.tiktoken").is_file() and (merged / "config.json").is_file()


def test_unknown_layouts_and_halves():
    with pytest.raises(ValueError, match="layout must be one of"):
        write_tiny_adapter("/nonexistent/x", "lycoris")
    with pytest.raises(ValueError, match="AR attention only"):
        write_tiny_adapter("/nonexistent/x", "slider-distill", half="nar")
