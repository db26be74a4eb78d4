"""The YuE2 Oobleck VAE in plain fp32 torch, with checkpoint-compatible names.

The decoder turns `[B, 64, T]` latents (25 frames/s) into `[B, 2, 1920*T - 64]` 48 kHz
stereo audio. Module layout, tensor names and arithmetic follow upstream's
`modeling_vae.py` (itself the stable-audio-tools Oobleck VAE with BigVGAN's SnakeBeta), so
a released `m-a-p/YuE2-Vae` checkpoint loads unchanged and decodes to the same samples.

`decode_tiled` decodes bounded tiles of latent frames with enough context on both sides that
every kept ("core") sample sees exactly the inputs it sees in a full decode; cores are cropped
and copied, never blended. The context needed is derived from the real modules
(`required_halo`), not hard-coded.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import (DTYPES, SINGLE_FILE, CheckpointError, Expected, TensorInfo, atomic_directory,
                         check_tensors, load_tensors, model_file, read_json, weight_index, write_json_atomic)

CONFIG_FILE = "config.json"
MODEL_TYPE = "yue2_vae"
ARCHITECTURE = "YuE2VAE"

# The released sub-configs (key order as in the release config.json).
RELEASE_ENCODER = dict(in_channels=2, channels=64, c_mults=[1, 2, 4, 8, 16, 32], strides=[2, 2, 4, 4, 5, 6],
                       latent_dim=128, use_snake=True)
RELEASE_DECODER = dict(out_channels=2, channels=64, c_mults=[1, 2, 4, 8, 16, 32], strides=[2, 2, 4, 4, 5, 6],
                       latent_dim=64, use_snake=True, snake_type="vanilla", use_filter=False, final_tanh=False)

# A key missing from a sub-config takes upstream's module default (stable-audio-tools' Oobleck
# defaults, e.g. final_tanh=True), exactly as upstream builds its modules from the same dict.
_ENCODER_DEFAULTS = dict(in_channels=2, channels=128, c_mults=[1, 2, 4, 8], strides=[2, 4, 8, 8], latent_dim=32,
                         use_snake=False)
_DECODER_DEFAULTS = dict(out_channels=2, channels=128, c_mults=[1, 2, 4, 8], strides=[2, 4, 8, 8], latent_dim=32,
                         use_snake=False, snake_type="vanilla", use_filter=False, final_tanh=True)
# Options upstream recognises but only accepts when off; they are checked and then dropped.
_ENCODER_OFF_OPTIONS = ("antialias_activation",)
_DECODER_OFF_OPTIONS = ("antialias_activation", "use_nearest_upsample", "use_filter")


# --------------------------------------------------------------------------- config


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"VAE config: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"VAE config: {name} must be true or false, got {value!r}")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"VAE config: {name} must be a non-empty list of integers, got {value!r}")
    return [_int(item, f"{name}[{i}]", 1) for i, item in enumerate(value)]


def _sub_config(given: Any, defaults: dict, off_options: tuple[str, ...], name: str) -> dict:
    """Normalize an encoder/decoder sub-config: fill upstream defaults, check types and options."""
    if not isinstance(given, Mapping):
        raise ValueError(f"VAE config: {name} must be an object, got {type(given).__name__}")
    for option in off_options:
        if given.get(option, False) is not False:
            raise ValueError(f"VAE config: {name}.{option}={given[option]!r} is not supported (the released "
                             f"VAE has it off)")
    merged = {key: copy.deepcopy(given.get(key, default)) for key, default in defaults.items()}
    for key, value in merged.items():
        path = f"{name}.{key}"
        if key in ("c_mults", "strides"):
            merged[key] = _int_list(value, path)
        elif isinstance(defaults[key], bool):
            merged[key] = _bool(value, path)
        elif isinstance(defaults[key], int):
            merged[key] = _int(value, path, 1)
    if len(merged["c_mults"]) != len(merged["strides"]):
        raise ValueError(f"VAE config: {name}.strides has {len(merged['strides'])} entries but {name}.c_mults "
                         f"has {len(merged['c_mults'])}")
    if merged.get("use_snake") and merged.get("snake_type", "vanilla") != "vanilla":
        raise ValueError(f"VAE config: {name}.snake_type={merged['snake_type']!r} is not supported (only 'vanilla')")
    return merged


@dataclass(frozen=True)
class VAEConfig:
    """The fields of m-a-p/YuE2-Vae's config.json (defaults are the released values).

    `from_dict` ignores keys it does not know (Hugging Face bookkeeping such as `auto_map` or
    `transformers_version`, and anything else), as upstream does; every field is type-checked
    and the architecture invariants are validated on construction.
    """

    sample_rate: int = 48000
    latent_dim: int = 64
    downsampling_ratio: int = 1920
    audio_channels: int = 2
    release_variant: str = "standard"
    decode_core_frames: int = 1024
    decode_halo_frames: int = 16
    encoder_config: dict = field(default_factory=lambda: copy.deepcopy(RELEASE_ENCODER))
    decoder_config: dict = field(default_factory=lambda: copy.deepcopy(RELEASE_DECODER))

    def __post_init__(self):
        # Like upstream, an empty or null sub-config means the released one.
        encoder = _sub_config(self.encoder_config or RELEASE_ENCODER, _ENCODER_DEFAULTS, _ENCODER_OFF_OPTIONS,
                              "encoder_config")
        decoder = _sub_config(self.decoder_config or RELEASE_DECODER, _DECODER_DEFAULTS, _DECODER_OFF_OPTIONS,
                              "decoder_config")
        object.__setattr__(self, "encoder_config", encoder)
        object.__setattr__(self, "decoder_config", decoder)
        _int(self.sample_rate, "sample_rate", 1)
        _int(self.latent_dim, "latent_dim", 1)
        _int(self.downsampling_ratio, "downsampling_ratio", 1)
        _int(self.audio_channels, "audio_channels", 1)
        _int(self.decode_core_frames, "decode_core_frames", 1)
        _int(self.decode_halo_frames, "decode_halo_frames", 0)
        if not isinstance(self.release_variant, str) or not self.release_variant:
            raise ValueError(f"VAE config: release_variant must be a non-empty string, got {self.release_variant!r}")
        if math.prod(decoder["strides"]) != self.downsampling_ratio:
            raise ValueError(f"VAE config: decoder_config.strides {decoder['strides']} multiply to "
                             f"{math.prod(decoder['strides'])}, not downsampling_ratio {self.downsampling_ratio}")
        if decoder["latent_dim"] != self.latent_dim:
            raise ValueError(f"VAE config: decoder_config.latent_dim {decoder['latent_dim']} != latent_dim "
                             f"{self.latent_dim}")
        if decoder["out_channels"] != self.audio_channels:
            raise ValueError(f"VAE config: decoder_config.out_channels {decoder['out_channels']} != audio_channels "
                             f"{self.audio_channels}")

    def __hash__(self):
        return hash(repr(self.to_dict()))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VAEConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"VAE config must be a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"VAE config: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        known = {f.name for f in fields(cls)}
        kwargs = {key: value for key, value in data.items() if key in known and value is not None}
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """A config.json upstream's `YuE2VAEConfig` accepts."""
        data: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in fields(self):
            data[f.name] = copy.deepcopy(getattr(self, f.name))
        return data

    @classmethod
    def load(cls, path: str | os.PathLike) -> VAEConfig:
        """Read `config.json` from a model directory (or a config file path)."""
        path = Path(path)
        file = model_file(path, CONFIG_FILE) if path.is_dir() else path
        try:
            return cls.from_dict(read_json(file))
        except CheckpointError:
            raise
        except ValueError as exc:
            raise CheckpointError(f"{file}: {exc}") from None


# --------------------------------------------------------------------------- layers


class _WeightNormConv(nn.Module):
    """A conv whose weight is `weight_g * weight_v / ||weight_v||` (norm over all dims but 0).

    Same parameters and arithmetic as `torch.nn.utils.weight_norm(conv)`. Without autograd the
    computed weight is cached, keyed on the parameters' storage and version counters, so any
    in-place update, reload or device move recomputes it.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1,
                 padding: int = 0, dilation: int = 1, bias: bool = True, transposed: bool = False):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
        shape = (in_channels, out_channels, kernel_size) if transposed else (out_channels, in_channels, kernel_size)
        # Placeholder values (weight exactly zero); real ones come from a checkpoint or `random_vae`.
        self.weight_g = nn.Parameter(torch.zeros(shape[0], 1, 1))
        self.weight_v = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self._cache: tuple[tuple, torch.Tensor] | None = None

    def _cache_key(self) -> tuple:
        g, v = self.weight_g, self.weight_v
        return (g.data_ptr(), g._version, v.data_ptr(), v._version, v.device, v.dtype)

    @property
    def weight(self) -> torch.Tensor:
        if torch.is_grad_enabled():
            return torch._weight_norm(self.weight_v, self.weight_g, 0)
        key = self._cache_key()
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, torch._weight_norm(self.weight_v, self.weight_g, 0))
        return self._cache[1]

    def _load_from_state_dict(self, *args, **kwargs):
        self._cache = None
        return super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        self._cache = None
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, bias={self.bias is not None}")


class WNConv1d(_WeightNormConv):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, transposed=False, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)

    def input_support(self, low: int, high: int) -> tuple[int, int]:
        reach = self.dilation * (self.kernel_size - 1)
        return low * self.stride - self.padding, high * self.stride - self.padding + reach

    def output_length(self, length: int) -> int:
        return (length + 2 * self.padding - self.dilation * (self.kernel_size - 1) - 1) // self.stride + 1


class WNConvTranspose1d(_WeightNormConv):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, transposed=True, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose1d(x, self.weight, self.bias, self.stride, self.padding, 0, 1, self.dilation)

    def input_support(self, low: int, high: int) -> tuple[int, int]:
        # Output o receives input i through tap j when o = i*stride - padding + j*dilation, 0 <= j < k.
        reach = self.dilation * (self.kernel_size - 1)
        return -((self.padding - reach + low) // -self.stride), (high + self.padding) // self.stride

    def output_length(self, length: int) -> int:
        return (length - 1) * self.stride - 2 * self.padding + self.dilation * (self.kernel_size - 1) + 1


class SnakeBeta(nn.Module):
    """BigVGAN's SnakeBeta with log-scale parameters: x + 1/(e^beta + 1e-9) * sin(x * e^alpha)^2."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same operations in the same order as upstream, for identical fp32 rounding.
        alpha = torch.exp(self.alpha.unsqueeze(0).unsqueeze(-1))
        beta = torch.exp(self.beta.unsqueeze(0).unsqueeze(-1))
        return x + (1.0 / (beta + 0.000000001)) * torch.pow(torch.sin(x * alpha), 2)


def _activation(use_snake: bool, channels: int) -> nn.Module:
    return SnakeBeta(channels) if use_snake else nn.ELU()


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int, use_snake: bool):
        super().__init__()
        self.layers = nn.Sequential(
            _activation(use_snake, channels),
            WNConv1d(channels, channels, 7, dilation=dilation, padding=3 * dilation),
            _activation(use_snake, channels),
            WNConv1d(channels, channels, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + x


class EncoderBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, use_snake: bool):
        super().__init__()
        self.layers = nn.Sequential(
            *(ResidualUnit(in_channels, d, use_snake) for d in (1, 3, 9)),
            _activation(use_snake, in_channels),
            WNConv1d(in_channels, out_channels, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class DecoderBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, use_snake: bool):
        super().__init__()
        self.layers = nn.Sequential(
            _activation(use_snake, in_channels),
            WNConvTranspose1d(in_channels, out_channels, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
            *(ResidualUnit(out_channels, d, use_snake) for d in (1, 3, 9)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class OobleckEncoder(nn.Module):
    """Audio `[B, in_channels, S]` -> `[B, latent_dim, S / prod(strides)]` (mean and scale halves)."""

    def __init__(self, in_channels: int, channels: int, latent_dim: int, c_mults: list[int], strides: list[int],
                 use_snake: bool):
        super().__init__()
        widths = [channels * m for m in [1, *c_mults]]
        self.layers = nn.Sequential(
            WNConv1d(in_channels, widths[0], 7, padding=3),
            *(EncoderBlock(widths[i], widths[i + 1], strides[i], use_snake) for i in range(len(widths) - 1)),
            _activation(use_snake, widths[-1]),
            WNConv1d(widths[-1], latent_dim, 3, padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class OobleckDecoder(nn.Module):
    """Latents `[B, latent_dim, T]` -> audio `[B, out_channels, ~T * prod(strides)]`."""

    def __init__(self, out_channels: int, channels: int, latent_dim: int, c_mults: list[int], strides: list[int],
                 use_snake: bool, final_tanh: bool):
        super().__init__()
        widths = [channels * m for m in [1, *c_mults]]
        self.layers = nn.Sequential(
            WNConv1d(latent_dim, widths[-1], 7, padding=3),
            *(DecoderBlock(widths[i], widths[i - 1], strides[i - 1], use_snake) for i in range(len(widths) - 1, 0, -1)),
            _activation(use_snake, widths[0]),
            WNConv1d(widths[0], out_channels, 7, padding=3, bias=False),
            nn.Tanh() if final_tanh else nn.Identity(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _encoder_kwargs(config: VAEConfig) -> dict:
    keys = ("in_channels", "channels", "latent_dim", "c_mults", "strides", "use_snake")
    return {key: config.encoder_config[key] for key in keys}


def _decoder_kwargs(config: VAEConfig) -> dict:
    keys = ("out_channels", "channels", "latent_dim", "c_mults", "strides", "use_snake", "final_tanh")
    return {key: config.decoder_config[key] for key in keys}


# --------------------------------------------------------------------------- receptive field

_POINTWISE = (SnakeBeta, nn.ELU, nn.Identity, nn.Tanh)
_CHAINS = (nn.Sequential, OobleckDecoder, DecoderBlock, OobleckEncoder, EncoderBlock)


def _children(module: nn.Module):
    return module if isinstance(module, nn.Sequential) else module.layers


def input_support(module: nn.Module, low: int, high: int) -> tuple[int, int]:
    """Inclusive input positions that output positions `[low, high]` of `module` depend on."""
    if isinstance(module, _CHAINS):
        for child in reversed(list(_children(module))):
            low, high = input_support(child, low, high)
        return low, high
    if isinstance(module, ResidualUnit):
        a, b = input_support(module.layers, low, high)
        return min(a, low), max(b, high)
    if isinstance(module, (WNConv1d, WNConvTranspose1d)):
        return module.input_support(low, high)
    if isinstance(module, _POINTWISE):
        return low, high
    raise TypeError(f"no receptive-field rule for {type(module).__name__}")


def output_length(module: nn.Module, length: int) -> int:
    """Output length of `module` for an input of `length` positions."""
    if isinstance(module, _CHAINS):
        for child in _children(module):
            length = output_length(child, length)
        return length
    if isinstance(module, (WNConv1d, WNConvTranspose1d)):
        return module.output_length(length)
    if isinstance(module, (ResidualUnit, *_POINTWISE)):
        return length
    raise TypeError(f"no length rule for {type(module).__name__}")


# --------------------------------------------------------------------------- model


class YuE2VAE(nn.Module):
    """`decoder` (always) and `encoder` (unless `decoder_only`), fp32, eval, without gradients."""

    def __init__(self, config: VAEConfig, *, decoder_only: bool = False):
        super().__init__()
        self.config = config
        self.encoder = None if decoder_only else OobleckEncoder(**_encoder_kwargs(config))
        self.decoder = OobleckDecoder(**_decoder_kwargs(config))
        self.eval().requires_grad_(False)

    @property
    def decoder_only(self) -> bool:
        return self.encoder is None

    @property
    def decoder_device(self) -> torch.device:
        return self.decoder.layers[0].weight_v.device

    def output_length(self, frames: int) -> int:
        """Samples decoded from `frames` latent frames (`1920*frames - 64` for the release)."""
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            raise ValueError(f"frames must be a positive integer, got {frames!r}")
        return output_length(self.decoder, frames)

    def required_halo(self, core_frames: int | None = None) -> int:
        """Latent frames of context each side of a core so that its samples are exact."""
        core = self.config.decode_core_frames if core_frames is None else core_frames
        if isinstance(core, bool) or not isinstance(core, int) or core < 1:
            raise ValueError(f"core_frames must be a positive integer, got {core!r}")
        low, high = input_support(self.decoder, 0, core * self.config.downsampling_ratio - 1)
        return max(0, -low, high - (core - 1))

    def _check_latent(self, latent) -> torch.Tensor:
        latent = torch.as_tensor(latent)
        dim = self.config.latent_dim
        if latent.ndim != 3 or latent.shape[0] < 1 or latent.shape[1] != dim or latent.shape[2] < 1:
            raise ValueError(f"expected non-empty latents [B, {dim}, T], got shape {list(latent.shape)}")
        if not torch.isfinite(latent).all():
            raise ValueError("VAE latents contain non-finite values")
        wrong = sorted({str(p.dtype) for p in self.decoder.parameters() if p.dtype != torch.float32})
        if wrong:
            raise ValueError(f"VAE decoder weights must stay float32, found {', '.join(wrong)}")
        return latent

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Full decode: fp32 `[B, 2, output_length(T)]` on the decoder's device, not clipped."""
        latent = self._check_latent(latent)
        device = self.decoder_device
        with torch.autocast(device_type=device.type, enabled=False):
            return self.decoder(latent.to(device=device, dtype=torch.float32))

    @torch.no_grad()
    def decode_tiled(self, latent: torch.Tensor, core_frames: int | None = None, halo_frames: int | None = None,
                     output_device: str | torch.device = "cpu",
                     on_progress: Callable[[int, int], None] | None = None,
                     cancelled: Callable[[], bool] | None = None) -> torch.Tensor:
        """Decode `core_frames` at a time with `halo_frames` of context each side; crop exact cores.

        The result equals `decode(latent)` up to convolution rounding (no crossfade, no padding).
        `on_progress(done, total)` runs after each tile is copied into the output; `cancelled()` is
        checked before each tile (InterruptedError).
        """
        latent = self._check_latent(latent)
        core = self.config.decode_core_frames if core_frames is None else core_frames
        halo = self.config.decode_halo_frames if halo_frames is None else halo_frames
        required = self.required_halo(core)
        if isinstance(halo, bool) or not isinstance(halo, int) or halo < required:
            raise ValueError(f"halo_frames must be an integer >= {required} for core_frames={core} with this "
                             f"decoder, got {halo!r}")
        frames, ratio = latent.shape[-1], self.config.downsampling_ratio
        total = self.output_length(frames)
        audio = torch.empty(latent.shape[0], self.config.audio_channels, total, dtype=torch.float32,
                            device=output_device)
        tiles = -(-frames // core)
        for index, start in enumerate(range(0, frames, core)):
            if cancelled is not None and cancelled():
                raise InterruptedError(f"cancelled while decoding audio (tile {index}/{tiles})")
            end = min(frames, start + core)
            left, right = max(0, start - halo), min(frames, end + halo)
            tile = self.decode(latent[..., left:right])
            out_start, out_end = start * ratio, min(end * ratio, total)
            offset = (start - left) * ratio
            crop = tile[..., offset:offset + out_end - out_start]
            if crop.shape[-1] != out_end - out_start:
                raise RuntimeError(f"VAE tile {index} covers {crop.shape[-1]} of {out_end - out_start} core samples")
            audio[..., out_start:out_end].copy_(crop)
            del tile, crop
            if on_progress is not None:
                on_progress(index + 1, tiles)
        return audio

    @torch.no_grad()
    def encode(self, audio: torch.Tensor, *, sample: bool = False,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Posterior mean latents `[B, 64, S / 1920]` (or a sample with `sample=True`)."""
        if self.encoder is None:
            raise RuntimeError("the VAE encoder is not loaded; load with decoder_only=False")
        audio = torch.as_tensor(audio)
        channels, ratio = self.config.encoder_config["in_channels"], self.config.downsampling_ratio
        if audio.ndim != 3 or audio.shape[1] != channels or audio.shape[-1] < ratio:
            raise ValueError(f"expected audio [B, {channels}, S] with S >= {ratio}, got shape {list(audio.shape)}")
        if not torch.isfinite(audio).all():
            raise ValueError("audio contains non-finite values")
        device = self.encoder.layers[0].weight_v.device
        with torch.autocast(device_type=device.type, enabled=False):
            mean, scale = self.encoder(audio.to(device=device, dtype=torch.float32)).chunk(2, dim=1)
        if not sample:
            return mean
        stdev = F.softplus(scale) + 1e-4
        return torch.randn(mean.shape, dtype=mean.dtype, device=device, generator=generator) * stdev + mean


# --------------------------------------------------------------------------- checkpoints


def expected_tensors(model: YuE2VAE) -> dict[str, Expected]:
    """Checkpoint layout of `model` (names and shapes, any dtype; fp32 is checked separately)."""
    return {name: Expected(tuple(p.shape), frozenset(DTYPES)) for name, p in model.state_dict().items()}


def _check_layout(found: Mapping[str, TensorInfo], expected: Mapping[str, Expected], what: str) -> None:
    """Report missing/unexpected/mis-shaped and non-F32 tensors together."""
    problems = []
    try:
        check_tensors(found, expected, what)
    except CheckpointError as exc:
        problems.append(str(exc))
    not_f32 = sorted(name for name, info in found.items() if info.dtype != "F32")
    if not_f32:
        listed = ", ".join(f"{name} is {found[name].dtype} in {found[name].file.name}" for name in not_f32[:10])
        more = f" (and {len(not_f32) - 10} more)" if len(not_f32) > 10 else ""
        problems.append(f"{what}: the VAE must be float32 (F32) but {len(not_f32)} tensors are not: {listed}{more}")
    if problems:
        raise CheckpointError("; ".join(problems))


def _checked_layout(root: Path, decoder_only: bool) -> tuple[YuE2VAE, dict[str, TensorInfo]]:
    """A meta-device model for the directory's config and its validated tensor headers."""
    config = VAEConfig.load(root)
    with torch.device("meta"):
        model = YuE2VAE(config, decoder_only=decoder_only)
    found = weight_index(root)
    if decoder_only:
        found = {name: info for name, info in found.items() if name.startswith("decoder.")}
    _check_layout(found, expected_tensors(model), f"{root}: VAE weights")
    return model, found


def check_vae(path: str | os.PathLike, *, decoder_only: bool = True) -> VAEConfig:
    """Validate a VAE directory (config, tensor names, shapes, float32) from headers alone; its config."""
    return _checked_layout(Path(path), decoder_only)[0].config


def load_vae(path: str | os.PathLike, *, decoder_only: bool = True,
             device: str | torch.device = "cpu") -> YuE2VAE:
    """Load a VAE directory (config.json + single or sharded safetensors), checked before reading.

    With `decoder_only`, only `decoder.*` tensors are considered; anything else in the files is
    ignored and never read.
    """
    model, found = _checked_layout(Path(path), decoder_only)
    state = dict(load_tensors(found.values(), device=device))
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def save_vae(model: YuE2VAE, directory: str | os.PathLike) -> Path:
    """Write `config.json` + fp32 `model.safetensors` (every tensor the model holds), atomically."""
    from safetensors.torch import save_file

    state = model.state_dict()
    wrong = sorted(name for name, tensor in state.items() if tensor.dtype != torch.float32)
    if wrong:
        raise ValueError(f"refusing to save a non-float32 VAE: {', '.join(wrong[:5])} ...")
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
    directory = Path(directory)
    with atomic_directory(directory) as tmp:
        write_json_atomic(tmp / CONFIG_FILE, model.config.to_dict())
        save_file(state, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
    return directory


# --------------------------------------------------------------------------- random weights


def _init_conv(conv: _WeightNormConv, generator: torch.Generator, gain: float) -> None:
    """Random direction, and a norm that keeps activations near unit scale for that gain."""
    v = conv.weight_v
    v.copy_(torch.randn(v.shape, generator=generator))
    if isinstance(conv, WNConvTranspose1d):
        # weight_g is per input channel, and each output sample sums kernel/stride taps per input channel.
        norm = gain * math.sqrt(conv.out_channels * conv.stride / conv.in_channels)
    else:
        norm = gain
    conv.weight_g.copy_(norm * (1 + 0.1 * torch.randn(conv.weight_g.shape, generator=generator)))
    if conv.bias is not None:
        conv.bias.copy_(0.01 * torch.randn(conv.bias.shape, generator=generator))


@torch.no_grad()
def random_vae(config: VAEConfig, seed: int, *, decoder_only: bool = False) -> YuE2VAE:
    """A deterministic randomly initialised VAE whose decode gives finite audio of modest scale."""
    model = YuE2VAE(config, decoder_only=decoder_only)
    generator = torch.Generator().manual_seed(seed)
    gains = {id(unit.layers[3]): 0.3 for unit in model.modules() if isinstance(unit, ResidualUnit)}
    gains[id(model.decoder.layers[-2])] = 0.03  # output convolution: audio of order 0.1
    for module in model.modules():
        if isinstance(module, SnakeBeta):
            module.alpha.copy_(0.1 * torch.randn(module.alpha.shape, generator=generator))
            module.beta.copy_(0.1 * torch.randn(module.beta.shape, generator=generator))
        elif isinstance(module, _WeightNormConv):
            # Residual branches start small so 18 stacked units do not blow the scale up.
            _init_conv(module, generator, gains.get(id(module), 1.0))
    return model


def decoder_bytes(config: VAEConfig) -> int:
    """fp32 bytes of the decoder `load_vae` keeps (counted on the meta device: no memory is used)."""
    with torch.device("meta"):
        decoder = OobleckDecoder(**_decoder_kwargs(config))
    return sum(t.numel() * 4 for t in (*decoder.parameters(), *decoder.buffers()))
