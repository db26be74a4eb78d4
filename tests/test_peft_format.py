"""PEFT's directory form: its file names and tensor names, in one place."""
from yue2_vllm import peft_format as peft


def test_names():
    assert (peft.CONFIG, peft.WEIGHTS, peft.KEY_PREFIX) == ("adapter_config.json", "adapter_model.safetensors",
                                                           "base_model.model.")
    a, b = peft.lora_keys("model.layers.3.self_attn.q_proj")
    assert (a, b) == ("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight",
                      "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight")
    assert peft.module_of(a) == "model.layers.3.self_attn.q_proj"
    assert peft.module_of(b) is None and peft.module_of("model.layers.3.self_attn.q_proj.lora_A.weight") is None
    assert peft.REQUIRED == ("r", "lora_alpha", "target_modules")
