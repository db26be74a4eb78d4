"""Tiny, deterministic YuE2 checkpoints with the real tensor names and vocabulary layout.

The tests and the demo run on these: a 2-layer MoT with the real 184,704-token vocabulary
(so every protocol id is real), a few-channel VAE with the real strides, and a synthetic
`qwen.tiktoken` with exactly 151,643 byte-level BPE ranks that the real loader accepts.
"""
from __future__ import annotations

import base64
import itertools
import os
from pathlib import Path

import torch

from .checkpoint import atomic_directory, cache_root, write_bytes_atomic, write_json_atomic
from .model.modeling import YuE2Config, sinusoid_table, tensor_shapes
from .tokenizer import ORDINARY_TOKENS, TOKENIZER_FILE

TINY_VERSION = "tiny-v1"
TINY_CONFIG = YuE2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, intermediate_size=256)
# Sampling budgets for the tiny default: a random model rarely samples an end token, so cap the
# phases (48 score tokens, 250 semantic tokens = 10 s of audio) to keep the default run to seconds.
TINY_GENERATION = {"abc": {"max_tokens": 48}, "semantic": {"min_tokens": 200, "max_tokens": 250}}
TINY_VAE_CHANNELS = 4
TINY_VAE_MULTS = [1, 2, 2, 4, 4, 8]


def synthetic_vocabulary() -> list[bytes]:
    """151,643 distinct byte strings: all single bytes, then lowercase/space n-grams and CJK characters.

    BPE can reach every n-gram through its prefixes, so English and Chinese text encode into
    multi-byte tokens as with the real file, and anything else falls back to bytes.
    """
    letters = b" abcdefghijklmnopqrstuvwxyz"
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)

    def add(token: bytes) -> bool:
        if token not in seen:
            seen.add(token)
            tokens.append(token)
        return len(tokens) >= ORDINARY_TOKENS

    for length in (2, 3):
        for combo in itertools.product(letters, repeat=length):
            add(bytes(combo))
    for lead in range(0xE4, 0xEA):  # CJK unified ideographs: 2-byte prefixes, then the characters
        for second in range(0x80, 0xC0):
            add(bytes([lead, second]))
    for code in range(0x4E00, 0xA000):
        add(chr(code).encode("utf-8"))
    for combo in itertools.product(letters, repeat=4):
        if add(bytes(combo)):
            break
    return tokens


def tiktoken_file_bytes() -> bytes:
    lines = (base64.b64encode(token) + b" %d\n" % rank for rank, token in enumerate(synthetic_vocabulary()))
    return b"".join(lines)


def _tiny_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, config: YuE2Config) -> torch.Tensor:
    """Scaled so that logits have std ≈ 1 and the NAR velocity clearly depends on the timestep."""
    if name == "latent_pos_embed.pe":
        return sinusoid_table(*shape)
    noise = torch.randn(shape, generator=generator)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.05 * noise
    if name == "model.embed_tokens.weight":
        return noise
    gain = 3.0 if name.startswith("time_embedder") else 1.0
    return gain * noise / shape[1] ** 0.5


def tiny_state_dict(config: YuE2Config = TINY_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: _tiny_tensor(name, shape, generator, config).to(torch.bfloat16).contiguous()
            for name, shape in sorted(tensor_shapes(config).items())}


def random_model(config: YuE2Config = TINY_CONFIG, seed: int = 0):
    """An in-memory MoT with the tiny checkpoints' initialisation (any size; used by benchmarks)."""
    from .model.modeling import YuE2Model, assign_tensor

    with torch.device("meta"):
        model = YuE2Model(config)
    for name, tensor in tiny_state_dict(config, seed).items():
        assign_tensor(model, name, tensor)
    return model.eval().requires_grad_(False)


def write_tiny_model(directory: str | os.PathLike, *, config: YuE2Config = TINY_CONFIG, seed: int = 0) -> Path:
    """Write `config.json`, `model.safetensors` (bf16) and `qwen.tiktoken` into a new directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    with atomic_directory(directory) as tmp:
        write_json_atomic(tmp / "config.json", config.to_dict())
        save_file(tiny_state_dict(config, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_bytes_atomic(tmp / TOKENIZER_FILE, tiktoken_file_bytes())
    return directory


def write_random_model(directory: str | os.PathLike, *, config: YuE2Config = TINY_CONFIG, seed: int = 0) -> Path:
    """`write_tiny_model` for any size, one tensor at a time (peak memory: the largest tensor, not the model):
    YuE2-3B's release layout at its real size (`YuE2Config()`, 6.76 GiB of bf16) with random weights."""
    from .checkpoint import write_safetensors_tensors

    directory = Path(directory)
    generator = torch.Generator().manual_seed(seed)

    def produce(name: str, shape: tuple[int, ...]):
        return lambda: _tiny_tensor(name, shape, generator, config).to(torch.bfloat16).contiguous()

    with atomic_directory(directory) as tmp:
        write_json_atomic(tmp / "config.json", config.to_dict())
        entries = [(name, "BF16", shape, produce(name, shape)) for name, shape in sorted(tensor_shapes(config).items())]
        write_safetensors_tensors(tmp / "model.safetensors", entries, metadata={"format": "pt"})
        write_bytes_atomic(tmp / TOKENIZER_FILE, tiktoken_file_bytes())
    return directory


def tiny_vae_config():
    from .model.vae import VAEConfig

    strides = [2, 2, 4, 4, 5, 6]
    return VAEConfig(
        encoder_config=dict(in_channels=2, channels=TINY_VAE_CHANNELS, c_mults=TINY_VAE_MULTS, strides=strides,
                            latent_dim=128, use_snake=True),
        decoder_config=dict(out_channels=2, channels=TINY_VAE_CHANNELS, c_mults=TINY_VAE_MULTS, strides=strides,
                            latent_dim=64, use_snake=True, snake_type="vanilla", use_filter=False, final_tanh=False),
    )


def write_tiny_vae(directory: str | os.PathLike, *, seed: int = 0) -> Path:
    from .model.vae import random_vae, save_vae

    save_vae(random_vae(tiny_vae_config(), seed), directory)
    return Path(directory)


def tiny_default(root: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """The embedded tiny default `(model_dir, vae_dir)`, generated once into the cache."""
    base = Path(root) if root is not None else cache_root() / TINY_VERSION
    model_dir, vae_dir = base / "YuE2-3B-tiny", base / "YuE2-Vae-tiny"
    for directory, write in ((model_dir, write_tiny_model), (vae_dir, write_tiny_vae)):
        if not directory.exists():
            try:
                write(directory)
            except FileExistsError:  # another process won the race; its rename is complete
                pass
    return model_dir, vae_dir
