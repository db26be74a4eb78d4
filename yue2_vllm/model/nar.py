"""NAR stage: semantic codec ids → `[T, 64]` audio latents by flow matching.

One fp32 noise draw `[T, 64]` on a CPU generator seeded with the request seed covers the whole
song; each context-sized chunk takes a view of it, is prefilled once with the AR expert and
then integrated from t=1 (noise) to t=0 (data) by the 32-step explicit midpoint method. The
ODE state lives in the model dtype (bf16), as upstream.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .lora import Edits
from .modeling import CachedNAR, YuE2Model, batched_velocities
from .placement import placement_of
from ..protocol import CODEC_OFFSET, CODEC_SIZE, CONTEXT, MUSIC_END, check_seed, check_token_ids, chunk_ranges

ProgressFn = Callable[[int, int], None]
LOGIT_CLAMP = 20.0


@dataclass
class NARChunk:
    tokens: list[int]  # full prompt prefix + this chunk's codec ids (+ offset) + MUSIC_END
    noise: torch.Tensor  # view into the song's single noise draw


def song_noise(frames: int, seed: int, latent_dim: int = 64) -> torch.Tensor:
    """The song's noise: one fp32 draw on a fresh CPU generator; the global RNG is untouched."""
    generator = torch.Generator(device="cpu").manual_seed(check_seed(seed))
    return torch.randn((frames, latent_dim), dtype=torch.float32, device="cpu", generator=generator)


def song_chunks(prefix: Sequence[int], codec: Sequence[int], seed: int, context: int = CONTEXT) -> list[NARChunk]:
    # The protocol's checks (and messages): integer ids and seed, never a float or bool coerced with int().
    prefix = check_token_ids(prefix, "prefix")
    codec = check_token_ids(codec, "semantic.tokens", 0, CODEC_SIZE, "a codec index")
    seed = check_seed(seed)
    if not prefix or not codec:
        raise ValueError("NAR needs a non-empty prefix and at least one semantic token")
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


@contextlib.contextmanager
def offloaded_ar(model: YuE2Model, enabled: bool = True):
    """The AR expert off the accelerator for the ODE steps, which only need the prefix K/V it left
    (`--offload-ar`): held on the host through the model's placement owner (`placement.ARPlacement`), which
    brings it back afterwards, also on errors or cancellation. A no-op on the CPU, and where the AR expert
    lives on the host anyway (a discrete GPU beside the engine)."""
    if not enabled or model.device.type == "cpu":
        yield
        return
    with placement_of(model).hold("host", "nar ode steps (--offload-ar)"):
        yield


def synthesize(model: YuE2Model, prefix: Sequence[int], codec: Sequence[int], seed: int, *, steps: int = 32,
               context: int = CONTEXT, cancelled: Callable[[], bool] | None = None,
               on_progress: ProgressFn | None = None, query_block: int | None = None,
               offload_ar: bool = False, record: dict | None = None, edits: Edits | None = None) -> torch.Tensor:
    """Latents `[len(codec), 64]` (CPU fp32), chunk after chunk; each chunk's prefix cache is freed after use.
    Progress counts chunk-steps: `steps × chunks` in all (as `synthesize_many`, which runs the chunks at once);
    `record["nar_chunks"]` says how many chunks.

    This is upstream's one-song path, bit for bit; `synthesize_many` batches songs. `record` (a dict) gets how
    the prefix prefill got its AR weights ("resident" or "streamed", and the bytes streamed). `edits` are the
    song's adapters (`lora.Edits`): its AR ones in the prefix prefill, its NAR ones in every velocity.
    """
    chunks = song_chunks(prefix, codec, seed, context)
    total = steps * len(chunks)
    if record is not None:
        record["nar_chunks"] = len(chunks)
    latents = []
    for index, chunk in enumerate(chunks):
        if cancelled is not None and cancelled():
            raise InterruptedError("cancelled before a flow-matching chunk")
        nar = prefilled(model, chunk.tokens, len(chunk.noise), query_block, record, edits)
        try:
            def on_step(done: int, _: int, offset: int = index * steps) -> None:
                if on_progress is not None:
                    on_progress(offset + done, total)

            with offloaded_ar(model, offload_ar):
                latents.append(solve(nar.velocity, chunk.noise, steps=steps, dtype=model.dtype, device=model.device,
                                     cancelled=cancelled, on_step=on_step))
        finally:
            nar.close()
    return torch.cat(latents)


@dataclass
class SongInput:
    """One song of a batched synthesis."""

    prefix: Sequence[int]
    codec: Sequence[int]
    seed: int
    cancelled: Callable[[], bool] | None = None
    on_progress: ProgressFn | None = None
    record: dict | None = None  # filled as `synthesize`'s
    edits: Edits | None = None  # the song's adapters, as `synthesize`'s


def prefilled(model: YuE2Model, tokens: list[int], frames: int, query_block: int | None,
              record: dict | None, edits: Edits | None = None) -> CachedNAR:
    """One chunk's prefix prefill, holding the AR expert where it is (no move can happen under it)."""
    with placement_of(model).hold("any", "nar prefix prefill"):
        nar = CachedNAR(model, tokens, frames, query_block=query_block, edits=edits)
    if record is not None:
        record["prefill_weights"] = nar.prefill_weights
        record["streamed_bytes"] = record.get("streamed_bytes", 0) + nar.streamed_bytes
    return nar


def synthesize_many(model: YuE2Model, songs: Sequence[SongInput], *, steps: int = 32, context: int = CONTEXT,
                    query_block: int | None = None, offload_ar: bool = False) -> list[torch.Tensor | BaseException]:
    """Several songs' latents in lockstep: every chunk of every song in one batched velocity per evaluation.

    Each song keeps its own noise, chunks and prefix; its latents equal `synthesize`'s within bf16
    rounding. The result per song is its latents or the exception that ended it (bad input,
    cancellation, non-finite latents), so one song never fails another.
    """
    results: list[torch.Tensor | BaseException | None] = [None] * len(songs)
    items: list[tuple[int, NARChunk]] = []
    chunk_counts = [0] * len(songs)
    for index, song in enumerate(songs):
        try:
            chunks = song_chunks(song.prefix, song.codec, song.seed, context)
        except ValueError as exc:
            results[index] = exc
            continue
        items += [(index, chunk) for chunk in chunks]
        chunk_counts[index] = len(chunks)
        if song.record is not None:
            song.record["nar_chunks"] = len(chunks)
    if steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    nars: list[CachedNAR] = []
    try:
        for owner, chunk in items:
            nars.append(prefilled(model, chunk.tokens, len(chunk.noise), query_block, songs[owner].record,
                                  songs[owner].edits))
        with offloaded_ar(model, offload_ar):
            states = [chunk.noise.to(device=model.device, dtype=model.dtype) for _, chunk in items]
            live = list(range(len(items)))
            dt = 1.0 / steps

            def evaluate(inputs: dict[int, torch.Tensor], raw: float) -> dict[int, torch.Tensor]:
                for index, song in enumerate(songs):  # cancellation is checked before every velocity call
                    if results[index] is None and song.cancelled is not None and song.cancelled():
                        results[index] = InterruptedError(f"cancelled during flow matching (step {step}/{steps})")
                keep = [i for i in inputs if results[items[i][0]] is None]
                out = batched_velocities([nars[i] for i in keep], [inputs[i] for i in keep], raw) if keep else []
                return dict(zip(keep, out))

            for step in range(steps):
                t = 1.0 - step * dt
                first = evaluate({i: states[i] for i in live}, raw_timestep(t))
                second = evaluate({i: states[i] - v * (dt / 2) for i, v in first.items()}, raw_timestep(t - dt / 2))
                live = list(second)
                for i, velocity in second.items():
                    states[i] = states[i] - velocity * dt
                if not live:
                    break
                for index, song in enumerate(songs):  # chunk-steps, as `synthesize` counts them
                    if results[index] is None and song.on_progress is not None:
                        song.on_progress((step + 1) * chunk_counts[index], steps * chunk_counts[index])
    finally:
        for nar in nars:
            nar.close()
    for index in range(len(songs)):
        if results[index] is None:
            latents = torch.cat([states[i] for i, (owner, _) in enumerate(items) if owner == index]).float().cpu()
            results[index] = latents if torch.isfinite(latents).all() else \
                FloatingPointError("flow matching produced non-finite latents")
    return results
