"""Independent reference computations for the tests (written from the spec, not from our fast paths)."""
import torch
import torch.nn.functional as F

from yue2_vllm.model.modeling import rope_angles


@torch.inference_mode()
def dense_nar_velocity(model, ar_tokens, state, raw_t):
    """One full MoT forward over [AR prefix | START, latents, END] with the hybrid attention mask.

    AR→AR causal, NAR→AR full, NAR→NAR bidirectional, AR→NAR blocked; every position routed to
    its expert; RoPE positions 0..S-1 over the whole sequence; latent positions 0..T+1.
    """
    config, backbone = model.config, model.model
    length, frames = len(ar_tokens), state.shape[0]
    slots = frames + 2
    total = length + slots
    ar_pos = torch.zeros(total, dtype=torch.bool)
    ar_pos[:length] = True
    x = backbone.embed_tokens(torch.tensor([list(ar_tokens) + [0] * slots]))
    latent = torch.zeros(slots, state.shape[1], dtype=model.dtype)
    latent[1:1 + frames] = state.to(model.dtype)
    t = model.shifted_timestep(raw_t)
    nar_in = model.vae2llm(latent[None]) + model.time_embedder(t.expand(slots))[None] \
        + model.latent_pos_embed.pe[torch.arange(slots).clamp(max=config.max_latent_frames - 1)][None]
    x[0, length:] = nar_in[0]
    causal = torch.ones(total, total).tril().bool()
    q_ar, k_ar = ar_pos[:, None], ar_pos[None, :]
    visible = (q_ar & k_ar & causal) | (~q_ar & k_ar) | (~q_ar & ~k_ar)
    mask = torch.zeros(total, total, dtype=model.dtype).masked_fill(~visible, float("-inf"))[None, None]
    cos, sin = rope_angles(torch.arange(total)[None], config.head_dim, config.rope_theta)
    route3, route4 = ar_pos[None, :, None], ar_pos[None, :, None, None]
    for layer in backbone.layers:
        qa, ka, va = layer.self_attn.project_qkv(layer.input_layernorm(x), cos, sin)
        qn, kn, vn = layer.nar_self_attn.project_qkv(layer.nar_input_layernorm(x), cos, sin)
        q, k, v = (torch.where(route4, a, n).transpose(1, 2) for a, n in ((qa, qn), (ka, kn), (va, vn)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).flatten(2)
        x = x + torch.where(route3, layer.self_attn.o_proj(out), layer.nar_self_attn.o_proj(out))
        x = x + torch.where(route3, layer.mlp(layer.post_attention_layernorm(x)),
                            layer.nar_mlp(layer.nar_pre_mlp_layernorm(x)))
    return model.llm2vae(backbone.norm(x))[0, length + 1:length + 1 + frames]
