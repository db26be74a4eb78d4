"""Which AR checkpoint the engine serves: a prepared (e.g. quantized) override as the quantized policy allows,
else the derived bf16 checkpoint (`derive`).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint import HashCache
from ..derive import OVERRIDE_ENV, ARCheckpoint, DerivationError, derive_ar_checkpoint, validate_ar_checkpoint
from ..model.modeling import YuE2Config
from ..options import QUANTIZED_POLICIES
from .schemes import device_info, engine_disabled_kernels, lora_reason, runnable_reason, slow_reason, w8a8_kernel


def resolve_ar_checkpoint(model_dir: str | os.PathLike, *, override: str | os.PathLike | None = None,
                          device_type: str = "cpu", cache_dir: str | os.PathLike | None = None,
                          hashes: HashCache | None = None, verify: bool = False,
                          quantized_policy: str = "auto", lora: bool = False, on_block=None) -> ARCheckpoint:
    """The override (argument, else `$YUE2_AR_CHECKPOINT`) validated, or the derived checkpoint (`on_block`:
    derive_ar_checkpoint's, hearing every block it copies or hashes).

    A quantized override that vLLM cannot run here (with LoRA slots when `lora`), or runs slower than bf16 here
    (`quant.schemes.slow_reason`), is declined for the derived bf16 checkpoint, on the record —
    unless `quantized_policy="force"`, which serves a slow one anyway (recorded as slow).
    """
    if quantized_policy not in QUANTIZED_POLICIES:
        raise ValueError(f"quantized_policy must be one of {QUANTIZED_POLICIES}, got {quantized_policy!r}")
    chosen = override or os.environ.get(OVERRIDE_ENV) or None
    mot = YuE2Config.load(model_dir)

    def derived(**why) -> ARCheckpoint:
        path = derive_ar_checkpoint(model_dir, cache_dir, hashes=hashes, verify=verify, on_block=on_block)
        return ARCheckpoint(path, "derived", None, **why)

    if not chosen:
        return derived()
    path = Path(chosen).expanduser().resolve()
    if not path.is_dir():
        raise DerivationError(f"{OVERRIDE_ENV}/ar_checkpoint {chosen}: not a directory")
    scheme = validate_ar_checkpoint(path, mot)
    device = device_info(device_type)
    capability = device.cuda_capability if device.type == "cuda" else None
    unservable = runnable_reason(scheme, device_type, capability) or (lora_reason(scheme, device) if lora else None)
    slow = slow_reason(scheme, device) if unservable is None else None
    choice = w8a8_kernel(scheme, capability, engine_disabled_kernels(scheme, capability)) if capability else None
    kernel = choice.to_dict() if choice is not None else None
    if unservable and quantized_policy == "force":
        return ARCheckpoint(path, "override", scheme, unservable, kernel=kernel)
    if unservable or (slow and quantized_policy == "auto"):
        return derived(declined=f"{path}: {unservable or slow}; serving the bf16 derived checkpoint "
                                f"(quantized_policy 'force' serves it anyway)")
    return ARCheckpoint(path, "override", scheme, slow=slow, kernel=kernel)
