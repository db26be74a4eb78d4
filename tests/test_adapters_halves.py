"""AR or NAR from the module names."""
import pytest

from yue2_vllm.adapters.halves import half_of, halves, projection, site


def test_halves_from_module_names():
    assert half_of("model.layers.3.self_attn.q_proj") == "ar"
    assert half_of("model.layers.3.mlp.down_proj") == "ar"
    assert half_of("model.layers.3.nar_self_attn.q_proj") == "nar"
    assert all(half_of(m) == "nar" for m in ("vae2llm", "llm2vae", "time_embedder.mlp.0"))
    assert halves(["model.layers.0.mlp.up_proj"]) == "ar"
    assert halves(["model.layers.0.nar_mlp.up_proj", "vae2llm"]) == "nar"
    assert halves(["model.layers.0.mlp.up_proj", "vae2llm"]) == "both"
    with pytest.raises(ValueError):
        halves([])


def test_names_inside_a_layer():
    assert projection("model.layers.3.nar_self_attn.k_proj") == "k_proj" and projection("vae2llm") == "vae2llm"
    assert site("model.layers.3.nar_self_attn.k_proj") == "nar_self_attn.k_proj" and site("llm2vae") == "llm2vae"
