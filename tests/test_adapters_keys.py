"""Tensor names of every layout read as (module, role); what is not a LoRA pair is named."""
import pytest

from yue2_vllm.adapters.keys import parse_key, refusal, unfused


@pytest.mark.parametrize("name, module, role, hint, form", [
    ("layers.3.self_attn.q_proj.lora_A", "model.layers.3.self_attn.q_proj", "a", None, "plain"),
    ("layers.27.nar_mlp.down_proj.lora_B", "model.layers.27.nar_mlp.down_proj", "b", None, "plain"),
    ("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight", "model.layers.0.mlp.up_proj", "a", None, "peft"),
    ("base_model.model.layers.0.mlp.up_proj.lora_B.weight", "model.layers.0.mlp.up_proj", "b", None, "peft"),
    ("model.layers.1.self_attn.o_proj.lora_A.default.weight", "model.layers.1.self_attn.o_proj", "a", None, "peft"),
    ("model.layers.2.nar_self_attn.k_proj.lora_B", "model.layers.2.nar_self_attn.k_proj", "b", None, "plain"),
    ("text_encoders.model.layers.4.self_attn.qkv_proj.lora_up.weight", "model.layers.4.self_attn.qkv_proj", "b", "ar",
     "comfyui"),
    ("text_encoders.model.layers.4.self_attn.qkv_proj.alpha", "model.layers.4.self_attn.qkv_proj", "alpha", "ar",
     "comfyui"),
    ("diffusion_model.model.layers.4.mlp.gate_up_proj.lora_A.weight", "model.layers.4.nar_mlp.gate_up_proj", "a",
     "nar", "comfyui"),
    ("diffusion_model.vae2llm.diff", "vae2llm", "diff", "nar", "comfyui"),
    ("diffusion_model.vae2llm.diff_b", "vae2llm", "diff_b", "nar", "comfyui"),
    ("adapters.model-layers-12-self_attn-q_proj.lora_down.weight", "model.layers.12.self_attn.q_proj", "a", None,
     "slider"),
    ("vae2llm.weight", "vae2llm", "weight", None, "plain"),
    ("llm2vae.bias", "llm2vae", "bias", None, "plain"),
    ("time_embedder.mlp.0.lora_A", "time_embedder.mlp.0", "a", None, "plain"),
    ("module.layers.0.mlp.gate_proj.lora_B", "model.layers.0.mlp.gate_proj", "b", None, "plain"),
])
def test_every_layouts_keys(name, module, role, hint, form):
    key = parse_key(name)
    assert (key.module, key.role, key.hint, key.form) == (module, role, hint, form)


@pytest.mark.parametrize("name, why", [
    ("layers.0.self_attn.foo_proj.lora_A", "not one of the adapted projections"),
    ("layers.0.self_attn.q_proj.weight", "whole replacement of a layer projection"),
    ("text_encoders.model.layers.0.nar_mlp.up_proj.lora_A.weight", "NAR module under the AR prefix"),
    ("text_encoders.vae2llm.diff", "NAR module under the AR prefix"),
    ("layers.0.self_attn.q_proj", "no role suffix"),
    ("something.else.lora_A", "names no module"),
])
def test_keys_that_name_nothing_of_yue2(name, why):
    with pytest.raises(KeyError, match=why):
        parse_key(name)


@pytest.mark.parametrize("name, what", [
    ("layers.0.self_attn.q_proj.lokr_w1", "LoKr"), ("lora_unet.x.hada_w1_a", "LoHa"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
    ("layers.0.self_attn.q_proj.dora_scale", "DoRA"), ("particles", "routed slider particle"),
    ("adapters.model-layers-0-self_attn-q_proj.bridge.router.0.weight", "routed slider particle"),
    ("hot_step.residual", "HOT-Step"), ("lm_head.lora_A", "lm_head"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "embeddings"),
])
def test_what_is_not_a_lora_pair_is_named(name, what):
    assert what in refusal(name)


def test_plain_keys_are_not_refused():
    assert refusal("layers.0.self_attn.q_proj.lora_A") is None
    assert refusal("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight") is None


def test_fused_names_stand_for_their_projections_in_row_order():
    assert unfused("model.layers.2.self_attn.qkv_proj") == (
        "model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.k_proj", "model.layers.2.self_attn.v_proj")
    assert unfused("model.layers.0.nar_mlp.gate_up_proj") == ("model.layers.0.nar_mlp.gate_proj",
                                                             "model.layers.0.nar_mlp.up_proj")
    assert unfused("model.layers.0.mlp.down_proj") is None and unfused("vae2llm") is None
