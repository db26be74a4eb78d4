"""Where the torch side runs, and with which numerics.

* `resolve_device`: `auto` picks CUDA, then MPS, then the CPU (upstream's order); a CUDA device
  always comes back with an index (`cuda` → `cuda:<current device>`), because
  `torch.cuda.set_per_process_memory_fraction` and friends refuse an unindexed one.
* `check_dtype_support`: a bf16 pipeline on a GPU without native bf16 (compute capability < 8.0)
  is refused with the card's name, as upstream refuses it.
* `set_upstream_numerics`: the six process-wide flags upstream's pipeline sets when it is built
  (cuDNN not benchmarking and deterministic, no TF32 in matmuls or convolutions, no reduced-precision
  fp16 reductions, float32 matmul precision "highest"). Without them the fp32 VAE's cuDNN
  convolutions run in TF32 and the audio lands ~1e-3 away from upstream's.
* `engine_cuda_env`: the `CUDA_VISIBLE_DEVICES` that pins the vLLM engine's worker to the
  pipeline's GPU (mapped through a `CUDA_VISIBLE_DEVICES` this process already has).
* `cuda_room` / `cuda_free_bytes`: what the caching allocator can still hand out on a GPU: the
  cached-but-unallocated blocks plus growth up to the per-process cap and the device's free bytes
  (`mem_get_info` alone ignores both the cap and the cache).
* `unified_memory`: whether a CUDA device shares the host's memory (an integrated GPU, e.g. DGX Spark's
  GB10): torch's `is_integrated`, checked against the capabilities of NVIDIA's integrated parts.

Importing this module imports torch only.
"""
from __future__ import annotations

import os
from typing import Mapping

import torch

SUPPORTED = "auto, cpu, cuda, cuda:N or mps"
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: native bf16 tensor-core math
# NVIDIA's integrated (unified-memory) GPUs by capability: Jetson Xavier, Jetson Orin, Jetson Thor, GB10 (DGX Spark).
INTEGRATED_CAPABILITIES = {(7, 2): "Jetson Xavier", (8, 7): "Jetson Orin", (11, 0): "Jetson Thor",
                           (12, 1): "GB10 (DGX Spark)"}
# Upstream's process-wide numerics (pipeline.py, set in YuE2Pipeline.__init__), as (flag, value).
UPSTREAM_NUMERICS = (
    ("cudnn.benchmark", False),
    ("cudnn.deterministic", True),
    ("cudnn.allow_tf32", False),
    ("cuda.matmul.allow_tf32", False),
    ("cuda.matmul.allow_fp16_reduced_precision_reduction", False),
    ("float32_matmul_precision", "highest"),
)


def _flag_owner(flag: str):
    """The torch.backends object and attribute a dotted flag name refers to."""
    owner, _, attr = flag.rpartition(".")
    target = torch.backends
    for part in owner.split("."):
        target = getattr(target, part)
    return target, attr


def set_upstream_numerics() -> dict:
    """Set upstream's six numerics flags (process-wide, idempotent); returns them as now set."""
    for flag, value in UPSTREAM_NUMERICS:
        if flag == "float32_matmul_precision":
            torch.set_float32_matmul_precision(value)
        else:
            target, attr = _flag_owner(flag)
            setattr(target, attr, value)
    return numerics_flags()


def numerics_flags() -> dict:
    """The current values of the six flags, by upstream's names."""
    values = {}
    for flag, _ in UPSTREAM_NUMERICS:
        if flag == "float32_matmul_precision":
            values[flag] = torch.get_float32_matmul_precision()
        else:
            target, attr = _flag_owner(flag)
            values[flag] = getattr(target, attr)
    return values


def numerics_differences() -> dict:
    """Flags whose current value is not upstream's: `{flag: (current, upstream)}` (empty when all match)."""
    current = numerics_flags()
    return {flag: (current[flag], value) for flag, value in UPSTREAM_NUMERICS if current[flag] != value}


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def device_problem(device: str) -> str | None:
    """Why `device` cannot run the pipeline on this machine, or None."""
    if not isinstance(device, str):
        return f"not a device name (use {SUPPORTED})"
    if device == "auto":
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return f"not a device (use {SUPPORTED})"
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            return f"CUDA is not available (torch {torch.__version__}, {torch.cuda.device_count()} CUDA devices)"
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            return f"there are only {torch.cuda.device_count()} CUDA devices"
    elif resolved.type == "mps":
        if not _mps_available():
            return "MPS is not available on this machine"
        if resolved.index not in (None, 0):
            return "there is only one MPS device (mps or mps:0)"
    elif resolved.type != "cpu":
        return f"device type {resolved.type!r} is not supported (use {SUPPORTED})"
    return None


def resolve_device(device: str) -> torch.device:
    """`auto` → CUDA, else MPS, else CPU; a CUDA device always carries its index."""
    problem = device_problem(device)
    if problem is not None:
        raise ValueError(f"device {device!r}: {problem}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def cuda_index(device: str | torch.device | int) -> int:
    """The index of a CUDA device (the current one for a bare `cuda`; an int is an index already)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{device} is not a CUDA device")
    return torch.cuda.current_device() if device.index is None else device.index


def bf16_problem(name: str, capability: tuple[int, int]) -> str | None:
    """Why a GPU of this compute capability cannot run YuE2's bf16 path natively, or None."""
    if tuple(capability) >= BF16_MIN_CAPABILITY:
        return None
    return (f"{name} (compute capability {capability[0]}.{capability[1]}) has no native bfloat16 (needs "
            f"{BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]}+, Ampere or newer); YuE2's AR and NAR run in bf16 "
            "(dtype='float32' runs them in float32 instead, slower and with other tokens)")


def check_dtype_support(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a bf16 pipeline on a CUDA GPU without native bf16 (upstream refuses it too)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return
    index = cuda_index(device)
    problem = bf16_problem(torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)))
    if problem is not None:
        raise ValueError(f"device {device}: {problem}")


def engine_cuda_env(device: str | torch.device, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`{"CUDA_VISIBLE_DEVICES": ...}` that shows the engine's worker only the pipeline's GPU; {} off CUDA.

    The index is this process's view: with `CUDA_VISIBLE_DEVICES=2,3` already set, `cuda:1` is
    physical GPU 3, so the worker gets `3`. The worker then sees that GPU as its `cuda:0`.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    index = cuda_index(device)
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return {"CUDA_VISIBLE_DEVICES": str(index)}
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if index >= len(entries):
        raise ValueError(f"{device} is not among CUDA_VISIBLE_DEVICES={visible!r} ({len(entries)} visible)")
    return {"CUDA_VISIBLE_DEVICES": entries[index]}


def cuda_room(*, free: int, reserved: int, allocated: int, cap: int | None) -> int:
    """Bytes the caching allocator can still hand out: its cached blocks plus what it may still reserve.

    `free`: the device's free bytes (`mem_get_info`, which counts this process's cached blocks as
    used); `reserved` / `allocated`: this process's allocator; `cap`: the per-process limit in
    bytes (None: none). Growth is bounded by both the device's free bytes and the cap.
    """
    if min(free, reserved, allocated) < 0 or allocated > reserved:
        raise ValueError(f"inconsistent memory figures: free {free}, reserved {reserved}, allocated {allocated}")
    growth = free if cap is None else min(free, max(0, cap - reserved))
    return (reserved - allocated) + growth


def process_cap_bytes(device: str | torch.device) -> int:
    """This process's CUDA allocator limit on `device` (fraction × total; the total when no cap is set)."""
    index = cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    return int(torch.cuda.get_per_process_memory_fraction(index) * total)


def cuda_free_bytes(device: str | torch.device) -> int:
    """`cuda_room` for this process on `device`, from the driver and the caching allocator."""
    index = cuda_index(device)
    free, _ = torch.cuda.mem_get_info(index)
    return cuda_room(free=int(free), reserved=int(torch.cuda.memory_reserved(index)),
                     allocated=int(torch.cuda.memory_allocated(index)), cap=process_cap_bytes(index))


def empty_cache(device: torch.device) -> None:
    """Give cached allocator blocks back (CUDA and MPS); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def unified_memory(device: str | torch.device | int) -> tuple[bool, str]:
    """`(unified, why)` for a CUDA device: unified when torch reports `is_integrated` (the GPU has no memory of its
    own; `total_memory` is the host's RAM). The capability confirms it for NVIDIA's known integrated parts; an
    integrated GPU of another capability is still planned as unified (one pool is the safe side), and says so."""
    index = cuda_index(device)
    integrated = bool(getattr(torch.cuda.get_device_properties(index), "is_integrated", False))
    capability = tuple(torch.cuda.get_device_capability(index))
    name = f"sm_{capability[0]}{capability[1]}"
    part = INTEGRATED_CAPABILITIES.get(capability)
    if not integrated:
        if part is not None:
            return False, f"{name} is {part}'s capability, but torch reports is_integrated=False: planned as discrete"
        return False, f"{name}, is_integrated=False: discrete memory"
    if part is None:
        return True, f"is_integrated=True on {name} (not a known integrated part): planned as unified memory"
    return True, f"is_integrated=True, {name}: {part}"
