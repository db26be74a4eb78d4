import copy

import pytest
import torch

from yue2_vllm.checkpoint import CheckpointError
from yue2_vllm.model.loader import load_model
from yue2_vllm.model.modeling import (CachedNAR, RMSNorm, YuE2Config, apply_rope, mps_sdpa_inputs, sdpa,
                               tensor_shapes)
from yue2_vllm.protocol import ABC_START, EOD, MUSIC_END, CODEC_OFFSET

from reference import dense_nar_velocity

PROMPT = [EOD, 40, 1771, 285, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, ABC_START]


def test_rmsnorm_multiplies_in_input_dtype():
    norm = RMSNorm(4, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.tensor([1.5, 0.5, 2.0, 1.0], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    scale = torch.rsqrt(torch.tensor(7.5) + 1e-6).to(torch.bfloat16)
    assert torch.equal(norm(x), x * scale * norm.weight)


def test_rope_is_half_split():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cos, sin = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    # pairs (x0, x2) and (x1, x3): rotate the first pair by 90 degrees, keep the second
    assert apply_rope(x, cos, sin).tolist() == [[-3.0, 2.0, 1.0, 4.0]]


def test_logits_have_unit_scale(tiny_model):
    logits = tiny_model.forward_ar(torch.tensor([PROMPT]), logits_to_keep=0).float()
    assert logits.shape == (1, len(PROMPT), 184704)
    assert 0.7 < logits.std(-1).mean().item() < 1.4


def test_chunked_prefill_and_decode_equal_full_forward(tiny_model):
    ids = torch.tensor([PROMPT + [300, 301, 302]])
    full = tiny_model.forward_ar(ids, logits_to_keep=0)
    cache = tiny_model.new_cache(32)
    keys_ptr = cache.keys[0].data_ptr()
    pieces = [tiny_model.forward_ar(ids[:, :7], cache, logits_to_keep=0),
              tiny_model.forward_ar(ids[:, 7:18], cache, logits_to_keep=0)]
    pieces += [tiny_model.forward_ar(ids[:, i:i + 1], cache) for i in range(18, 21)]
    chunked = torch.cat(pieces, dim=1)
    assert cache.length == 21 and cache.keys[0].data_ptr() == keys_ptr
    # bf16 GEMMs of other shapes round differently, so compare with a bf16 tolerance and the argmax.
    torch.testing.assert_close(chunked.float(), full.float(), atol=0.05, rtol=0.02)


def test_prefill_then_decode_matches_fp32_exactly_enough(tiny_model):
    model = copy.deepcopy(tiny_model).float()
    ids = torch.tensor([PROMPT + [300, 301]])
    full = model.forward_ar(ids, logits_to_keep=0)
    cache = model.new_cache(len(PROMPT) + 2)
    steps = [model.forward_ar(ids[:, :len(PROMPT)], cache)]
    steps += [model.forward_ar(ids[:, i:i + 1], cache) for i in (len(PROMPT), len(PROMPT) + 1)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, -3:], atol=2e-5, rtol=1e-5)


def test_cache_overflow_is_an_error(tiny_model):
    cache = tiny_model.new_cache(4)
    with pytest.raises(ValueError, match="capacity 4 exceeded"):
        tiny_model.forward_ar(torch.tensor([PROMPT[:5]]), cache)


def test_cache_reset_reuses_the_buffers(tiny_model):
    cache = tiny_model.new_cache(len(PROMPT) + 1)
    buffers = [k.data_ptr() for k in cache.keys]
    first = tiny_model.forward_ar(torch.tensor([PROMPT]), cache)
    tiny_model.forward_ar(torch.tensor([[40]]), cache)
    assert cache.length == len(PROMPT) + 1
    cache.reset()
    assert cache.length == 0
    again = tiny_model.forward_ar(torch.tensor([PROMPT]), cache)  # would overflow without the reset
    assert torch.equal(again, first) and [k.data_ptr() for k in cache.keys] == buffers
    decode = tiny_model.forward_ar(torch.tensor([[40]]), cache)
    fresh = tiny_model.new_cache(len(PROMPT) + 1)
    tiny_model.forward_ar(torch.tensor([PROMPT]), fresh)
    assert torch.equal(decode, tiny_model.forward_ar(torch.tensor([[40]]), fresh))


def chunk_tokens(codec):
    return PROMPT + [CODEC_OFFSET + c for c in codec] + [MUSIC_END]


@pytest.mark.parametrize("raw_t", [20.0, 0.0, -2.3])
def test_cached_nar_equals_dense_reference_fp32(tiny_model, raw_t):
    model = copy.deepcopy(tiny_model).float()
    tokens = chunk_tokens([5, 7, 32767, 0, 9])
    state = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    cached = CachedNAR(model, tokens, frames=5).velocity(state, raw_t)
    dense = dense_nar_velocity(model, tokens, state, raw_t)
    torch.testing.assert_close(cached, dense, atol=1e-5, rtol=1e-5)


def test_cached_nar_equals_dense_reference_bf16_and_query_blocks(tiny_model):
    tokens = chunk_tokens(list(range(40)))
    state = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    dense = dense_nar_velocity(tiny_model, tokens, state, 1.5).float()
    whole = CachedNAR(tiny_model, tokens, frames=40).velocity(state, 1.5).float()
    blocked = CachedNAR(tiny_model, tokens, frames=40, query_block=16).velocity(state, 1.5).float()
    assert (whole - dense).abs().max() < 0.05 * dense.abs().max()
    assert (blocked - whole).abs().max() < 0.05 * dense.abs().max()


def test_velocity_depends_on_time_and_state(tiny_model):
    nar = CachedNAR(tiny_model, chunk_tokens([1, 2, 3]), frames=3)
    state = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    v_noise, v_data = nar.velocity(state, 20.0).float(), nar.velocity(state, -20.0).float()
    assert (v_noise - v_data).abs().mean() > 0.1 * v_noise.abs().mean()
    assert (nar.velocity(state * 0, 20.0).float() - v_noise).abs().mean() > 0.1 * v_noise.abs().mean()
    nar.close()
    with pytest.raises(RuntimeError, match="closed"):
        nar.velocity(state, 0.0)


def test_tiny_layout_matches_real_layout_modulo_layers():
    from yue2_vllm.testing import TINY_CONFIG

    def strip(names):
        return {n.split(".", 3)[-1] if n.startswith("model.layers.") else n for n in names}

    real, tiny = tensor_shapes(YuE2Config()), tensor_shapes(TINY_CONFIG)
    assert len(real) == 628 and len(tiny) == 3 + 22 * 2 + 9
    assert strip(real) == strip(tiny)


def test_loader_rejects_missing_and_misshaped_tensors(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.1.nar_mlp.up_proj.weight"]
    state["llm2vae.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
    state["extra.weight"] = torch.zeros(1, dtype=torch.bfloat16)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_model(bad)
    message = str(info.value)
    assert "missing 1: model.layers.1.nar_mlp.up_proj.weight" in message
    assert "unexpected 1: extra.weight" in message
    assert "llm2vae.weight: shape [64, 64]" in message and "expected [64, 128]" in message


def test_loader_rejects_truncated_file(tiny_model_dir, tmp_path):
    import shutil

    bad = tmp_path / "trunc"
    shutil.copytree(tiny_model_dir, bad)
    path = bad / "model.safetensors"
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: tensor "):
        load_model(bad)


def test_loader_rejects_config_mismatch(tiny_model_dir, tmp_path):
    import json
    import shutil

    bad = tmp_path / "cfg"
    shutil.copytree(tiny_model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing 22: model.layers.2."):
        load_model(bad)
    config["latent_type"] = "mel"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: config.latent_type"):
        load_model(bad)


def test_unknown_config_keys_are_ignored(tiny_model_dir, tmp_path, caplog):
    """A config.json saved by another transformers version (extra bookkeeping keys) still loads."""
    import json
    import logging
    import shutil

    other = tmp_path / "saved"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update({"_name_or_path": "m-a-p/YuE2-3B", "layer_types": ["full_attention"] * 2, "some_future_key": 1})
    (other / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.DEBUG, logger="yue2_vllm.model.modeling"):
        assert YuE2Config.load(other) == YuE2Config.load(tiny_model_dir)
        model = load_model(other)
    assert model.config.num_hidden_layers == 2
    assert "ignoring unknown field(s) ['_name_or_path', 'layer_types', 'some_future_key']" in caplog.text


def test_sdpa_is_one_native_gqa_call_off_mps():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, heads, 6, 8, generator=g) for heads in (4, 2, 2))
    native = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(sdpa(q, k, v, is_causal=True), native)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mps_workarounds_repeat_kv_and_mask_half_precision_causal(dtype):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 6, 8, generator=g).to(dtype) for h in (4, 2, 2))
    key, value, mask, causal = mps_sdpa_inputs(q, k, v, None, True)
    assert key.shape == value.shape == (1, 4, 6, 8)
    assert torch.equal(key[:, 1], k[:, 0]) and torch.equal(key[:, 2], k[:, 1])
    if dtype == torch.bfloat16:
        assert causal is False and torch.equal(mask, torch.ones(6, 6, dtype=torch.bool).tril())
    else:
        assert causal is True and mask is None
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True))
