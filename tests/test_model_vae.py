"""The fp32 Oobleck VAE: config, tensor layout, numerics, tiled decode and checkpoint loading."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from yue2_vllm.checkpoint import CheckpointError
from yue2_vllm.model.vae import (RELEASE_DECODER, RELEASE_ENCODER, SnakeBeta, VAEConfig, WNConv1d, WNConvTranspose1d,
                           YuE2VAE, load_vae, random_vae, save_vae)

STRIDES = [2, 2, 4, 4, 5, 6]
MULTS = [1, 2, 2, 4, 4, 8]


def tiny_config(**overrides) -> VAEConfig:
    encoder = dict(in_channels=2, channels=4, c_mults=MULTS, strides=STRIDES, latent_dim=128, use_snake=True)
    decoder = dict(out_channels=2, channels=4, c_mults=MULTS, strides=STRIDES, latent_dim=64, use_snake=True,
                   snake_type="vanilla", use_filter=False, final_tanh=False)
    return VAEConfig(encoder_config=encoder, decoder_config=decoder, **overrides)


@pytest.fixture(scope="module")
def vae() -> YuE2VAE:
    return random_vae(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def latent() -> torch.Tensor:
    return torch.randn(2, 64, 23, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(vae, tmp_path_factory):
    return save_vae(vae, tmp_path_factory.mktemp("vae") / "YuE2-Vae-tiny")


def rewrite(src, dst, edit):
    """Copy a saved VAE to `dst`, passing its state dict through `edit` first."""
    from safetensors.torch import load_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# --------------------------------------------------------------------------- config


def test_default_config_is_the_release():
    data = VAEConfig().to_dict()
    assert data["model_type"] == "yue2_vae" and data["architectures"] == ["YuE2VAE"]
    assert data["encoder_config"] == RELEASE_ENCODER and data["decoder_config"] == RELEASE_DECODER
    assert (data["sample_rate"], data["latent_dim"], data["downsampling_ratio"], data["audio_channels"]) == (
        48000, 64, 1920, 2)
    assert (data["release_variant"], data["decode_core_frames"], data["decode_halo_frames"]) == ("standard", 1024, 16)


def test_config_round_trip_ignores_hf_keys(tmp_path):
    data = tiny_config().to_dict() | {"transformers_version": "4.57.0", "torch_dtype": "float32",
                                      "auto_map": {"AutoModel": "modeling_vae.YuE2VAE"}}
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert VAEConfig.load(tmp_path) == tiny_config()
    assert VAEConfig.from_dict(json.loads(json.dumps(VAEConfig().to_dict()))) == VAEConfig()


@pytest.mark.parametrize("change, field", [
    ({"downsampling_ratio": 1600}, "downsampling_ratio"),
    ({"latent_dim": 32}, "latent_dim"),
    ({"decode_core_frames": 0}, "decode_core_frames"),
    ({"decode_halo_frames": -1}, "decode_halo_frames"),
    ({"decoder_config": RELEASE_DECODER | {"use_filter": True}}, "use_filter"),
    ({"decoder_config": RELEASE_DECODER | {"snake_type": "snake"}}, "snake_type"),
    ({"decoder_config": RELEASE_DECODER | {"antialias_activation": True}}, "antialias_activation"),
    ({"decoder_config": RELEASE_DECODER | {"use_nearest_upsample": True}}, "use_nearest_upsample"),
    ({"encoder_config": RELEASE_ENCODER | {"antialias_activation": True}}, "antialias_activation"),
    ({"decoder_config": RELEASE_DECODER | {"strides": [2, 2, 4, 4, 5, 5]}}, "strides"),
    ({"decoder_config": RELEASE_DECODER | {"latent_dim": 32}}, "latent_dim"),
])
def test_config_rejects_unsupported(change, field):
    with pytest.raises(ValueError, match=field):
        VAEConfig.from_dict(VAEConfig().to_dict() | change)


def test_config_load_error_names_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(VAEConfig().to_dict() | {"downsampling_ratio": 7}))
    with pytest.raises(CheckpointError, match="config.json.*downsampling_ratio"):
        VAEConfig.load(tmp_path)


# --------------------------------------------------------------------------- layout (real size, meta device)


def test_real_decoder_tensor_layout():
    with torch.device("meta"):
        model = YuE2VAE(VAEConfig())
    shapes = {name: list(p.shape) for name, p in model.state_dict().items()}
    assert shapes["decoder.layers.0.weight_g"] == [2048, 1, 1]
    assert shapes["decoder.layers.0.weight_v"] == [2048, 64, 7]
    assert shapes["decoder.layers.0.bias"] == [2048]
    assert shapes["decoder.layers.1.layers.0.alpha"] == [2048]
    assert shapes["decoder.layers.1.layers.1.weight_v"] == [2048, 1024, 12]  # conv-transpose, stride 6
    assert shapes["decoder.layers.1.layers.1.weight_g"] == [2048, 1, 1]
    assert shapes["decoder.layers.1.layers.1.bias"] == [1024]
    assert shapes["decoder.layers.2.layers.1.weight_v"] == [1024, 512, 10]  # stride 5
    assert shapes["decoder.layers.1.layers.4.layers.1.weight_v"] == [1024, 1024, 7]  # dilation-9 unit
    assert shapes["decoder.layers.1.layers.4.layers.3.weight_v"] == [1024, 1024, 1]
    assert shapes["decoder.layers.7.beta"] == [64]
    assert shapes["decoder.layers.8.weight_v"] == [2, 64, 7]
    assert "decoder.layers.8.bias" not in shapes and "decoder.layers.9.weight_v" not in shapes
    assert shapes["encoder.layers.0.weight_v"] == [64, 2, 7]
    assert shapes["encoder.layers.8.weight_v"] == [128, 2048, 3]
    decoder_mib = sum(math.prod(s) for n, s in shapes.items() if n.startswith("decoder.")) * 4 / 2**20
    assert round(decoder_mib, 1) == 253.2  # the VAE card's decoder-only fp32 size


def test_real_decoder_lengths_and_halo():
    with torch.device("meta"):
        model = YuE2VAE(VAEConfig(), decoder_only=True)
    assert [model.output_length(t) for t in (1, 2, 1024)] == [1856, 3776, 1920 * 1024 - 64]
    # Measured 12 for every core size; upstream's default halo of 16 covers it.
    assert {model.required_halo(core) for core in (1, 2, 7, 64, 1024)} == {12}
    assert model.required_halo() <= 16


# --------------------------------------------------------------------------- numerics


def test_snake_beta_hand_value():
    snake = SnakeBeta(2)
    with torch.no_grad():
        snake.alpha.copy_(torch.tensor([0.0, math.log(2.0)]))
        snake.beta.copy_(torch.tensor([0.0, math.log(0.5)]))
    x = torch.tensor([[[0.5], [0.5]]])
    # channel 0: 0.5 + sin(0.5)^2 / 1 ; channel 1: 0.5 + sin(1.0)^2 / 0.5
    expected = [0.5 + math.sin(0.5) ** 2, 0.5 + 2 * math.sin(1.0) ** 2]
    assert snake(x).flatten().tolist() == pytest.approx(expected, rel=1e-6)


@pytest.mark.filterwarnings("ignore:.*weight_norm.*deprecated:FutureWarning")
@pytest.mark.parametrize("transposed", [False, True])
def test_weight_norm_conv_matches_torch(transposed):
    from torch.nn.utils import weight_norm

    gen = torch.Generator().manual_seed(5)
    if transposed:
        ours = WNConvTranspose1d(6, 4, 10, stride=5, padding=3)
        ref = weight_norm(torch.nn.ConvTranspose1d(6, 4, 10, stride=5, padding=3))
    else:
        ours = WNConv1d(6, 4, 7, dilation=3, padding=9)
        ref = weight_norm(torch.nn.Conv1d(6, 4, 7, dilation=3, padding=9))
    state = {name: torch.randn(t.shape, generator=gen) for name, t in ref.state_dict().items()}
    assert set(state) == set(ours.state_dict()) == {"weight_g", "weight_v", "bias"}
    ref.load_state_dict(state)
    ours.load_state_dict(state)
    x = torch.randn(2, 6, 31, generator=gen)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        ours(x)  # cache the weight, then change it: the cache must follow
        ours.load_state_dict({k: v * 2 for k, v in state.items()})
        ref.load_state_dict({k: v * 2 for k, v in state.items()})
        assert torch.equal(ours(x), ref(x))
        ours.weight_g.mul_(0.5)
        ref.weight_g.mul_(0.5)
        assert torch.equal(ours(x), ref(x))


def test_decode_shape_scale_and_determinism(vae, latent):
    audio = vae.decode(latent)
    assert audio.dtype == torch.float32 and audio.shape == (2, 2, 1920 * 23 - 64) == (2, 2, vae.output_length(23))
    assert torch.isfinite(audio).all()
    assert 0.01 < audio.std() < 1 and audio.abs().max() < 5
    assert torch.equal(random_vae(tiny_config(), seed=0).decode(latent), audio)
    assert not torch.equal(random_vae(tiny_config(), seed=1).decode(latent), audio)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # decode runs with autocast off
        assert torch.equal(vae.decode(latent), audio)


def test_decode_rejects_bad_input(vae, latent):
    with pytest.raises(ValueError, match="64"):
        vae.decode(latent[:, :32])
    with pytest.raises(ValueError, match="64"):
        vae.decode(latent[0])
    bad = latent.clone()
    bad[0, 3, 4] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        vae.decode(bad)
    half = random_vae(tiny_config(), seed=0, decoder_only=True).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        half.decode(latent)


def test_encode(vae):
    audio = 0.1 * torch.randn(1, 2, 1920 * 3, generator=torch.Generator().manual_seed(2))
    mean = vae.encode(audio)
    assert mean.shape == (1, 64, 3) and torch.isfinite(mean).all()
    draw = [vae.encode(audio, sample=True, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], mean)
    with pytest.raises(RuntimeError, match="decoder_only=False"):
        random_vae(tiny_config(), seed=0, decoder_only=True).encode(audio)


# --------------------------------------------------------------------------- tiled decode


@pytest.mark.parametrize("core, halo", [(4, 12), (5, 16), (7, 12), (10, 16), (23, 16), (64, 16)])
def test_tiled_equals_full(vae, latent, core, halo):
    full = vae.decode(latent)
    progress = []
    tiled = vae.decode_tiled(latent, core, halo, on_progress=lambda done, total: progress.append((done, total)))
    tiles = -(-23 // core)
    assert progress == [(i + 1, tiles) for i in range(tiles)]
    # Not bitwise on CPU: oneDNN picks different kernels for different lengths, giving last-bit
    # differences (measured max 4.5e-7 at |audio| < 1). Cores are exact up to that rounding.
    assert tiled.shape == full.shape and tiled.device.type == "cpu"
    assert (tiled - full).abs().max() <= 1e-6


@pytest.mark.slow
def test_tiled_equals_full_real_size():
    model = random_vae(VAEConfig(), seed=0, decoder_only=True)
    latent = torch.randn(1, 64, 40, generator=torch.Generator().manual_seed(3))
    full = model.decode(latent)
    assert 0.01 < full.std() < 1
    # fp32 rounding only: the convolutions sum in another order per tile length (max difference measured 3.8e-7 on
    # an AVX-512 CPU, 4.5e-6 on an AVX2 one); a halo one frame short is off by orders of magnitude more.
    for core, halo in ((8, 12), (16, 16)):
        assert (model.decode_tiled(latent, core, halo) - full).abs().max() <= 2e-5


def test_required_halo_is_tight(vae, latent, monkeypatch):
    full = vae.decode(latent)
    required = vae.required_halo(5)
    assert required == 12
    monkeypatch.setattr(vae, "required_halo", lambda core=None: 0)
    short = vae.decode_tiled(latent, 5, required - 1)
    assert (short - full).abs().max() > 1e-5  # one frame less context visibly changes the cores


def test_tiled_rejects_short_halo(vae, latent):
    with pytest.raises(ValueError, match="halo_frames must be an integer >= 12"):
        vae.decode_tiled(latent, 8, 11)
    with pytest.raises(ValueError, match=">= 12"):
        random_vae(tiny_config(decode_halo_frames=4), seed=0).decode_tiled(latent)


# --------------------------------------------------------------------------- checkpoints


def test_save_load_round_trip(vae, saved, latent):
    full = load_vae(saved, decoder_only=False)
    assert full.state_dict().keys() == vae.state_dict().keys()
    assert all(torch.equal(t, vae.state_dict()[n]) for n, t in full.state_dict().items())
    assert full.config == vae.config and not full.training
    assert not any(p.requires_grad for p in full.parameters())
    decoder = load_vae(saved)  # decoder_only: encoder tensors in the file are ignored
    assert decoder.encoder is None
    assert {n.split(".")[0] for n in decoder.state_dict()} == {"decoder"}
    assert torch.equal(decoder.decode(latent), vae.decode(latent))
    with pytest.raises(FileExistsError):
        save_vae(vae, saved)


def test_sharded_checkpoint(vae, saved, tmp_path, latent):
    from safetensors.torch import load_file

    state = load_file(saved / "model.safetensors")
    shards = {"a.safetensors": {n: t for n, t in state.items() if n.startswith("encoder.")},
              "b.safetensors": {n: t for n, t in state.items() if n.startswith("decoder.")}}
    for name, part in shards.items():
        save_file(part, tmp_path / name, metadata={"format": "pt"})
    index = {"weight_map": {n: name for name, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    assert torch.equal(load_vae(tmp_path).decode(latent), vae.decode(latent))
    assert load_vae(tmp_path, decoder_only=False).encoder is not None


def test_loader_rejects_bf16(saved, tmp_path):
    bf16 = rewrite(saved, tmp_path / "bf16", lambda s: {n: t.to(torch.bfloat16) for n, t in s.items()})
    with pytest.raises(CheckpointError, match=r"float32.*decoder\.layers\.0\.bias is BF16"):
        load_vae(bf16)
    one = rewrite(saved, tmp_path / "one", lambda s: s | {"decoder.layers.8.weight_v": s[
        "decoder.layers.8.weight_v"].to(torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"1 tensors are not: decoder\.layers\.8\.weight_v is BF16"):
        load_vae(one)


def test_loader_reports_all_problems_at_once(saved, tmp_path):
    def edit(state):
        del state["decoder.layers.3.layers.2.layers.1.weight_g"]
        state["decoder.layers.0.bias"] = torch.zeros(7)
        state["decoder.layers.8.bias"] = torch.zeros(2)
        return state

    with pytest.raises(CheckpointError) as error:
        load_vae(rewrite(saved, tmp_path / "bad", edit))
    message = str(error.value)
    assert "missing 1: decoder.layers.3.layers.2.layers.1.weight_g" in message
    assert "unexpected 1: decoder.layers.8.bias" in message
    assert "decoder.layers.0.bias: shape [7]" in message and "expected [32]" in message


def test_loader_rejects_truncated_file(saved, tmp_path):
    cut = rewrite(saved, tmp_path / "cut", dict)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        load_vae(cut)


def test_decoder_only_checkpoint_needs_decoder_only_load(saved, tmp_path):
    only = rewrite(saved, tmp_path / "only", lambda s: {n: t for n, t in s.items() if n.startswith("decoder.")})
    assert load_vae(only).encoder is None
    with pytest.raises(CheckpointError, match="missing .*encoder.layers.0.weight_v"):
        load_vae(only, decoder_only=False)
