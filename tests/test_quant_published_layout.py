"""The released YuE2-3B layout (yue2-facts §3.3), written out by hand and checked against a full-size
model built on the meta device: no 7 GB allocation, same names and shapes as the real checkpoint."""
import torch

from yue2_vllm.model.modeling import YuE2Config, YuE2Model, ar_tensor_shapes, tensor_shapes

H, KV, FF, V, HD = 2048, 1024, 6144, 184704, 128


def published_layout():
    layout = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,),
              "llm2vae.weight": (64, H), "llm2vae.bias": (64,), "vae2llm.weight": (H, 64), "vae2llm.bias": (H,),
              "time_embedder.mlp.0.weight": (H, 256), "time_embedder.mlp.0.bias": (H,),
              "time_embedder.mlp.2.weight": (H, H), "time_embedder.mlp.2.bias": (H,),
              "latent_pos_embed.pe": (24576, H)}
    for i in range(28):
        for expert, attn, mlp, norm1, norm2 in (("", "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"),
                                                ("nar", "nar_self_attn", "nar_mlp", "nar_input_layernorm",
                                                 "nar_pre_mlp_layernorm")):
            p = f"model.layers.{i}."
            layout.update({
                p + f"{norm1}.weight": (H,), p + f"{norm2}.weight": (H,),
                p + f"{attn}.q_proj.weight": (H, H), p + f"{attn}.k_proj.weight": (KV, H),
                p + f"{attn}.v_proj.weight": (KV, H), p + f"{attn}.o_proj.weight": (H, H),
                p + f"{attn}.q_norm.weight": (HD,), p + f"{attn}.k_norm.weight": (HD,),
                p + f"{mlp}.gate_proj.weight": (FF, H), p + f"{mlp}.up_proj.weight": (FF, H),
                p + f"{mlp}.down_proj.weight": (H, FF),
            })
    return layout


def test_meta_model_matches_published_layout():
    with torch.device("meta"):
        model = YuE2Model(YuE2Config())
    state = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert all(t.is_meta for t in model.state_dict().values())
    published = published_layout()
    assert len(published) == 628
    assert state == published
    assert tensor_shapes(YuE2Config()) == published
    params = sum(t.numel() for t in model.state_dict().values())
    assert round(params / 1e9, 2) == 3.63
    assert round(params * 2 / 2**30, 2) == 6.76  # bf16 GiB, as the community GGUF reports


def test_ar_subset_is_311_tensors():
    ar = ar_tensor_shapes(YuE2Config())
    assert len(ar) == 311
    assert not any("nar" in name or name.startswith(("llm2vae", "vae2llm", "time_", "latent_")) for name in ar)
    assert round(sum(torch.Size(s).numel() for s in ar.values()) / 1e9, 2) == 2.17
