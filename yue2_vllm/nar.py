"""NAR stage: semantic codec ids → `[T, 64]` audio latents by flow matching.

One fp32 noise draw `[T, 64]` on a CPU generator seeded with the request seed covers the whole
song; each context-sized chunk takes a view of it, is prefilled once with the AR expert and
then integrated from t=1 (noise) to t=0 (data) by the 32-step explicit midpoint method. The
ODE state lives in the model dtype (bf16), as upstream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .modeling import CachedNAR, YuE2Model
from .protocol import CODEC_OFFSET, CODEC_SIZE, CONTEXT, MUSIC_END, chunk_ranges

ProgressFn = Callable[[int, int], None]
LOGIT_CLAMP = 20.0


@dataclass
class NARChunk:
    tokens: list[int]  # full prompt prefix + this chunk's codec ids (+ offset) + MUSIC_END
    noise: torch.Tensor  # view into the song's single noise draw


def song_noise(frames: int, seed: int, latent_dim: int = 64) -> torch.Tensor:
    """The song's noise: one fp32 draw on a fresh CPU generator; the global RNG is untouched."""
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randn((frames, latent_dim), dtype=torch.float32, device="cpu", generator=generator)


def song_chunks(prefix: Sequence[int], codec: Sequence[int], seed: int, context: int = CONTEXT) -> list[NARChunk]:
    prefix, codec = [int(t) for t in prefix], [int(c) for c in codec]
    if not prefix or not codec:
        raise ValueError("NAR needs a non-empty prefix and at least one semantic token")
    bad = [c for c in codec if not 0 <= c < CODEC_SIZE]
    if bad:
        raise ValueError(f"semantic tokens must be codec indices in [0, {CODEC_SIZE}), got e.g. {bad[0]}")
    noise = song_noise(len(codec), seed)
    return [NARChunk(prefix + [CODEC_OFFSET + c for c in codec[a:b]] + [MUSIC_END], noise[a:b])
            for a, b in chunk_ranges(len(codec), len(prefix), context)]


def raw_timestep(t: float) -> float:
    """`logit(t)` in float64, clamped to ±20 (so t=1 gives 20)."""
    return torch.logit(torch.tensor(t, dtype=torch.float64)).clamp(-LOGIT_CLAMP, LOGIT_CLAMP).item()


def solve(velocity: Callable[[torch.Tensor, float], torch.Tensor], noise: torch.Tensor, *, steps: int = 32,
          dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
          cancelled: Callable[[], bool] | None = None, on_step: ProgressFn | None = None) -> torch.Tensor:
    """Explicit midpoint from t=1 to t=0 (`state -= v·dt`); returns CPU fp32 latents."""
    if steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    state = noise.to(device=device, dtype=dtype)
    dt = 1.0 / steps
    for step in range(steps):
        t = 1.0 - step * dt
        if cancelled is not None and cancelled():
            raise InterruptedError(f"cancelled during flow matching (step {step}/{steps})")
        first = velocity(state, raw_timestep(t))
        midpoint = state - first * (dt / 2)
        if cancelled is not None and cancelled():
            raise InterruptedError(f"cancelled during flow matching (step {step}/{steps})")
        state = state - velocity(midpoint, raw_timestep(t - dt / 2)) * dt
        if on_step is not None:
            on_step(step + 1, steps)
    result = state.float().cpu()
    if not torch.isfinite(result).all():
        raise FloatingPointError("flow matching produced non-finite latents")
    return result


def synthesize(model: YuE2Model, prefix: Sequence[int], codec: Sequence[int], seed: int, *, steps: int = 32,
               context: int = CONTEXT, cancelled: Callable[[], bool] | None = None,
               on_progress: ProgressFn | None = None, query_block: int | None = None) -> torch.Tensor:
    """Latents `[len(codec), 64]` (CPU fp32), chunk after chunk; each chunk's prefix cache is freed after use."""
    chunks = song_chunks(prefix, codec, seed, context)
    total = steps * len(chunks)
    latents = []
    for index, chunk in enumerate(chunks):
        if cancelled is not None and cancelled():
            raise InterruptedError("cancelled before a flow-matching chunk")
        nar = CachedNAR(model, chunk.tokens, len(chunk.noise), query_block=query_block)
        try:
            def on_step(done: int, _: int, offset: int = index * steps) -> None:
                if on_progress is not None:
                    on_progress(offset + done, total)

            latents.append(solve(nar.velocity, chunk.noise, steps=steps, dtype=model.dtype, device=model.device,
                                 cancelled=cancelled, on_step=on_step))
        finally:
            nar.close()
    return torch.cat(latents)
