"""Memory admission: the device room songs' buffers may still take, and what a stage needs before it runs (the NAR's
chunks, a torch AR phase, a VAE tile) admitted into the engine's room. The budget a pipeline runs in is resolved
with its options (resolved.py).

The one memory model is memory.py's; the one room is room.py's DeviceRoom, which the engine's life
(engine_life.py) creates beside a vLLM engine on a discrete GPU. Everything here reads those.
"""
from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch

from ..devices import cuda_free_bytes
from ..memory import ar_host_bytes, nar_song_bytes, torch_decode_bytes, unified_pool
from ..model.placement import placement_of
from ..protocol import Sampling, chunk_ranges
from ..room import DeviceRoom
from .results import Cancelled, OnProgress, SemanticResult


def device_room(device: torch.device, room: DeviceRoom | None, unified) -> int | None:
    """Bytes songs' buffers may still take on the accelerator (None on the CPU): the room's free bytes
    beside the engine on a discrete GPU, the unified pool now (MemAvailable less the OS reserve, what the
    plan reads; cudaMemGetInfo under-reports there), else what this process can still allocate."""
    if device.type != "cuda":
        return None
    if room is not None:
        return room.free
    if unified is not None:
        return unified_pool().pool
    return cuda_free_bytes(device)


@contextlib.contextmanager
def admitted(room: DeviceRoom | None, need: int, what: str, on_progress: Sequence[OnProgress | None] = (),
             cancelled: Cancelled | None = None, records: Sequence[dict] = ()):
    """Hold `need` bytes of the room for a stage (a no-op without one); a wait is reported to its songs as
    progress of stage `<stage>_wait` (need, free bytes) and recorded."""
    if room is None:
        yield
        return
    stage = what.split()[0]

    def waiting(need_bytes: int, free: int) -> None:
        for report in on_progress:
            if report is not None:
                report(f"{stage}_wait", need_bytes, free)

    start = time.perf_counter()
    with room.admit(need, what, on_wait=waiting, cancelled=cancelled):
        for record in records:
            record.update({"room_need_bytes": need, "room_wait_seconds": time.perf_counter() - start})
        yield


def nar_need(config, semantics: Sequence[SemanticResult], context: int, ar_on_device: bool) -> int:
    """Device bytes a NAR run of these songs takes beyond the resident weights (memory.nar_song_bytes): every
    chunk's prefix K/V and activations, and one streamed AR layer when the AR expert is in host memory."""
    chunks = [len(s.plan.prefix) + (b - a) + 3 for s in semantics  # prefix, codec, end, 2 latent slots
              for a, b in chunk_ranges(len(s.tokens), len(s.plan.prefix), context)]
    return nar_song_bytes(config, chunks, streamed=not ar_on_device)


@contextlib.contextmanager
def torch_ar_admitted(room: DeviceRoom | None, model, prefix_tokens: int, sampling: Sampling, phase: str,
                      kwargs: dict):
    """A torch-backend AR phase holds the AR expert on the device (placement owner; moved from host memory,
    counted, when it lives there) and, beside the engine, is admitted into the room for those weights and
    its CFG branches' K/V first."""
    branches = 2 if kwargs.get("cfg_scale", 1.0) != 1.0 or kwargs.get("legacy_off") else 1
    need = torch_decode_bytes(model.config, prefix_tokens + sampling.max_tokens, branches)
    placement = placement_of(model)
    if placement.home == "host":
        need += ar_host_bytes(model.config, model.dtype.itemsize)
    with admitted(room, need, f"{phase} phase on the torch backend", (), kwargs.get("cancelled")), \
            placement.hold("device", f"{phase} phase (torch backend)"):
        yield
