"""Quantizing the AR half on the torch path: int8 checkpoints, load-time int8/FP8 proxies, memory caps.

Only the 7 AR linears of each layer are touched (`self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`; 196 at 28 layers) — never `lm_head`, the embeddings or any
`nar_*` module.

* `quantize_int8` is the one int8 quantizer: symmetric, one bf16 scale per output channel
  (`max|w_row| / 127`), `q = round(w / scale)` in [-127, 127]. The `yue2-int8-ar` export and
  the load-time proxies both call it, so a saved checkpoint gives bit-identical logits to
  quantizing the bf16 model at load time.
* `Int8Linear` runs `torch._weight_int8pack_mm` where a probe shows it works for the input's
  device and dtype (x86/ARM CPU and Apple MPS in recent torch), else dequantises;
  `proxy_slow_reason` declines int8 proxies on an accelerator without the kernel (CUDA).
* `FP8Linear`: upstream's per-tensor scales by default (`scheme="tensor"`), or per-channel/per-token
  (`scheme="channel"`, row-wise `_scaled_mm`).
* `export_int8_ar` writes a full MoT directory in the `yue2-int8-ar` format, streamed tensor by
  tensor; `loader.load_model` reads it back.
* `prepare_ar_proxies(model, "int8" | "fp8")` swaps the AR linears for proxies and keeps the
  exact originals on the CPU; `restore_ar` puts them back layer by layer before the NAR stage.
* `memory_cap` / `apply_memory_cap`: the process memory budget with a 2 GiB reserve.

Importing this module imports torch only (no vLLM, Triton or llm-compressor).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import cuda_index
from ..options import QUANTIZATIONS as LOAD_MODES  # noqa: F401 (the loader's name for them)
from .modeling import CONFIG_FILE, YuE2Config, checkpoint_layout, tensor_shapes
from ..checkpoint import (SINGLE_FILE, CheckpointError, Expected, HashCache, TensorInfo, atomic_directory,
                         check_tensors, model_file, read_json, weight_index, write_json_atomic,
                         tensor_blocks, write_safetensors_tensors)

INT8_AR_METHOD = "yue2-int8-ar"
INT8_MAX = 127
FP8_MAX = 448.0  # float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)
FP8_SCHEMES = ("tensor", "channel")  # per-tensor scales (upstream's, the default) | per channel/token (row-wise)
GIB = 2**30
AR_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROXY_MODES = ("int8", "fp8")
ORIGINALS_ATTR = "_yue2_ar_originals"  # plain dict attribute: model.to() never moves what it holds
STATUS_ATTR = "quantization_status"
KERNEL_ALIGNMENT = 64  # bytes; torch's CPU allocator alignment
KERNEL_K_MULTIPLE = 32  # in_features the packed kernel is trusted with (MPS needs 32; x86 CPU breaks off 16)


# --------------------------------------------------------------------------- names


def ar_linear_names(num_layers: int) -> list[str]:
    """Module names of the 7·layers AR linears, layer by layer."""
    return [f"model.layers.{layer}.{name}" for layer in range(num_layers) for name in AR_LINEARS]


def checkpoint_method(config: dict, where: str = "config.json") -> str | None:
    """`quantization_config.method` of a MoT config.json: None (bf16) or "yue2-int8-ar"; others raise."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("method", qc.get("quant_method")) if isinstance(qc, dict) else qc
    if method != INT8_AR_METHOD:
        raise ValueError(f"{where}: quantization_config method {method!r} is not supported for a YuE2 MoT "
                         f"checkpoint (only {INT8_AR_METHOD!r}; FP8 AR checkpoints are Qwen3 AR directories for vLLM)")
    return method


def int8_ar_layout(shapes: dict[str, tuple[int, ...]], num_layers: int) -> dict[str, Expected]:
    """The `yue2-int8-ar` layout from the bf16 shapes: int8 AR weights, bf16 scales, the rest unchanged."""
    layout = {name: Expected(shape) for name, shape in shapes.items()}
    for module in ar_linear_names(num_layers):
        out_features = shapes[f"{module}.weight"][0]
        layout[f"{module}.weight"] = Expected(shapes[f"{module}.weight"], frozenset({"I8"}))
        layout[f"{module}.weight_scale"] = Expected((out_features,), frozenset({"BF16"}))
    return layout


# --------------------------------------------------------------------------- int8


def _check_weight(weight: torch.Tensor) -> None:
    if weight.ndim != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D floating-point weight, got {weight.dtype}{list(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight holds inf or NaN; refusing to quantize it")


@torch.no_grad()
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: `(q int8 [out, in], scale bf16 [out])`.

    `scale = max|w_row| / 127` rounded to bf16 (the stored value), `q = round(w / scale)`
    (half to even) clamped to ±127, computed in fp32 on the weight's device. A zero row gets
    scale 1 and q 0. IEEE division and rounding make the result the same on every device.
    """
    _check_weight(weight)
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = (amax / INT8_MAX).clamp_min(torch.finfo(torch.bfloat16).tiny)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale)).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[:, None]


_INT8PACK_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def int8pack_available(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._weight_int8pack_mm` runs *and gives the right answer* for this device type and dtype.

    Probed once per (device type, dtype) with K=64, N=32 (the MPS kernel wants multiples of 32)
    against an fp32 reference (within one rounding of `dtype`); a kernel that exists but returns
    garbage (as reported for bf16 on some MPS builds) counts as absent.
    """
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _INT8PACK_WORKS:
        works = False
        if hasattr(torch, "_weight_int8pack_mm"):
            try:
                k = torch.arange(64, dtype=torch.float32)
                x = torch.stack([k % 5 - 2, k % 3 - 1]).to(dtype=dtype, device=device)
                w = ((torch.arange(32)[:, None] + k[None, :]) % 7 - 3).to(dtype=torch.int8, device=device)
                s = (torch.arange(32, dtype=torch.float32) % 4 + 1).to(dtype=dtype, device=device)
                got = torch._weight_int8pack_mm(x, w, s).float().cpu()
                want = ((x.float().cpu() @ w.float().cpu().T) * s.float().cpu()).to(dtype).float()
                works = got.shape == want.shape and torch.allclose(got, want, rtol=2e-2, atol=1e-2)
            except (RuntimeError, NotImplementedError, TypeError):
                works = False
        _INT8PACK_WORKS[key] = works
    return _INT8PACK_WORKS[key]


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its data is 64-byte aligned, else an aligned copy (torch's CPU allocator aligns to 64)."""
    return tensor if tensor.data_ptr() % KERNEL_ALIGNMENT == 0 else tensor.clone()


def use_int8pack(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the packed kernel serves this call: it works for the device/dtype and K is a multiple of 32.

    On x86 CPU (torch 2.13) the kernel was seen to return wrong values or crash for K not a
    multiple of 16, and to crash on operands not 16/32-byte aligned; `int8_linear` aligns them.
    """
    return weight.shape[1] % KERNEL_K_MULTIPLE == 0 and int8pack_available(x.device, x.dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                kernel: bool | None = None) -> torch.Tensor:
    """`x @ (weight·scale)ᵀ (+ bias)` in x's dtype; `kernel` None = the packed kernel when `use_int8pack` says so.

    The kernel accumulates in fp32 and scales the fp32 sum; the fallback dequantises the weight
    to x's dtype (`q.to(dtype) * scale`) and calls F.linear.
    """
    if kernel is None:
        kernel = use_int8pack(x, weight)
    if kernel:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if rows.device.type == "cpu":
            rows, weight = _aligned(rows), _aligned(weight)
        out = torch._weight_int8pack_mm(rows, weight, scale.to(x.dtype)).reshape(*x.shape[:-1], weight.shape[0])
        return out + bias.to(x.dtype) if bias is not None else out
    return F.linear(x, dequantize_int8(weight, scale, x.dtype), None if bias is None else bias.to(x.dtype))


class Int8Linear(nn.Module):
    """Drop-in for a bias-free (or biased) nn.Linear with int8 weights and bf16 per-channel scales.

    Buffers `weight` (int8 [out, in]) and `weight_scale` (bf16 [out]) — the names of the
    `yue2-int8-ar` checkpoint — and `bias` when the source had one. Output dtype = input dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.bfloat16, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        module = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        module.weight, module.weight_scale = quantize_int8(linear.weight)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return module

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_int8(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.device.type == "cpu" and self.weight.data_ptr() % KERNEL_ALIGNMENT:
            self.weight = self.weight.clone()  # e.g. a tensor read from safetensors at an 8-byte offset
        return int8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# --------------------------------------------------------------------------- fp8


@torch.no_grad()
def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel float8_e4m3fn: `(q [out, in], scale fp32 [out])`, scale = amax/448 (1 for zero rows)."""
    _check_weight(weight)
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@torch.no_grad()
def quantize_fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One float8_e4m3fn scale for the whole tensor (upstream's scheme, weights and activations alike):
    `(q, scale fp32 [1])` with scale = max(amax, 1e-12)/448, computed from the fp32 values."""
    x = x.detach().float()
    scale = x.abs().amax().clamp_min(1e-12) / FP8_MAX
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(1)


def quantize_fp8_per_token(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization of `[M, K]` rows: `(fp8 [M, K], fp32 scale [M, 1])`."""
    x = rows.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_supported(device: str | torch.device) -> str | None:
    """None when `torch._scaled_mm` FP8 proxies can run on this device, else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"FP8 proxies need a CUDA GPU with compute capability >= 8.9 (float8 _scaled_mm); "
                f"the model is on {device}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return (f"FP8 proxies need compute capability >= 8.9 (Ada/Hopper/Blackwell); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")
    return None


class FP8Linear(nn.Module):
    """W8A8 FP8 proxy: e4m3 weights and activations quantized at run time, in one of two schemes.

    * `scheme="tensor"` (default, upstream's experimental FP8): one fp32 scale for the weight and one
      for each call's activations, so the tokens can match upstream's FP8 path; per-tensor
      `_scaled_mm` runs on every FP8 GPU (sm89+).
    * `scheme="channel"`: fp32 per-output-channel weight scales and per-token activation scales
      (row-wise `_scaled_mm`, which older torch/cuBLAS builds support only on sm90+); closer to bf16,
      other tokens than upstream's.

    On CUDA (sm89+) forward calls `torch._scaled_mm`, rows padded to a multiple of 16 (zero rows
    change neither scheme's scales). Elsewhere it raises, unless `reference=True`: a slow
    dequantising reference of the same arithmetic (fp8 values x scales, fp32 matmul) meant for tests.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, reference: bool = False,
                 scheme: str = "tensor", device=None):
        super().__init__()
        if scheme not in FP8_SCHEMES:
            raise ValueError(f"FP8 scheme must be one of {FP8_SCHEMES}, got {scheme!r}")
        if in_features % 16 or out_features % 16:
            raise ValueError(f"FP8 _scaled_mm needs dimensions that are multiples of 16, "
                             f"got {out_features}x{in_features}")
        self.in_features, self.out_features, self.reference, self.scheme = in_features, out_features, reference, scheme
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        scales = 1 if scheme == "tensor" else out_features
        self.register_buffer("weight_scale", torch.ones(scales, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, reference: bool = False, scheme: str = "tensor") -> "FP8Linear":
        module = cls(linear.in_features, linear.out_features, reference=reference, scheme=scheme, device="meta")
        if scheme == "tensor":
            _check_weight(linear.weight)
            module.weight, module.weight_scale = quantize_fp8_per_tensor(linear.weight)
        else:
            module.weight, module.weight_scale = quantize_fp8(linear.weight)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return module

    def _quantize_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_per_tensor(rows) if self.scheme == "tensor" else quantize_fp8_per_token(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if x.device.type == "cuda" and not self.reference:
            out = self._scaled_mm(rows)
        elif self.reference:
            q, scale = self._quantize_rows(rows)
            scale_w = self.weight_scale if self.scheme == "tensor" else self.weight_scale[:, None]
            weight = self.weight.float() * scale_w
            out = ((q.float() * scale) @ weight.T).to(x.dtype)
        else:
            raise RuntimeError(fp8_supported(x.device) + " (reference=True gives a slow dequantising reference)")
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out + self.bias.to(x.dtype) if self.bias is not None else out

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        out_dtype = rows.dtype if rows.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        m = rows.shape[0]
        pad = -m % 16
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        q, scale = self._quantize_rows(rows)
        weight_scale = self.weight_scale if self.scheme == "tensor" else self.weight_scale[None, :]
        out = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype,
                               use_fast_accum=False)
        if isinstance(out, tuple):  # older torch returned (out, amax)
            out = out[0]
        return out[:m].to(rows.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.scheme}, reference={self.reference}")


# --------------------------------------------------------------------------- load-time proxies


def _layers(model: nn.Module):
    try:
        return model.model.layers
    except AttributeError:
        raise TypeError("expected a YuE2Model (model.model.layers)") from None


def _swap(layer: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(layer.get_submodule(owner), attr, module)


def _kernel_name(mode: str, device: torch.device, dtype: torch.dtype, reference: bool = False,
                 fp8_scheme: str = "tensor") -> str:
    if mode == "int8":
        return "_weight_int8pack_mm" if int8pack_available(device, dtype) else "dequantize+F.linear"
    if reference:
        return "dequantize reference (fp32 matmul)"
    return "_scaled_mm per-tensor" if fp8_scheme == "tensor" else "_scaled_mm rowwise"


def proxy_slow_reason(mode: str, device: str | torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why load-time proxies of `mode` would make the torch AR half slower than bf16 on `device`, or None.

    int8 proxies on an accelerator without a working `_weight_int8pack_mm` for `dtype` (torch has
    CPU and MPS kernels, none for CUDA) would dequantize the whole weight on every call: declined, as
    `quantization.slow_reason` declines slow checkpoints for vLLM. On the CPU the dequantising
    fallback is kept (both run there; not measured as slower). FP8 proxies are not judged here:
    `_scaled_mm` is their kernel, and a device without it is refused by `check_proxy_device`.
    """
    device = torch.device(device)
    if mode != "int8" or device.type == "cpu" or int8pack_available(device, dtype):
        return None
    return (f"int8 proxies on {device.type.upper()} have no _weight_int8pack_mm kernel for "
            f"{str(dtype).removeprefix('torch.')} in torch {torch.__version__}: every call would dequantize the "
            "weight and run slower than bf16, so the AR half runs in bf16 (quantized_policy 'force' keeps them)")


def _proxy_status(model: nn.Module, mode: str, count: int, reference: bool, original_dtype: torch.dtype,
                  fp8_scheme: str = "tensor") -> dict:
    per_tensor = fp8_scheme == "tensor"
    return {
        "mode": mode, "source": "load_time", "active_ar_linears": count,
        "weight_format": "int8" if mode == "int8" else "float8_e4m3fn",
        "weight_scales": "bfloat16 per output channel" if mode == "int8" else
        "float32 per tensor" if per_tensor else "float32 per output channel",
        "activations": "model dtype" if mode == "int8" else
        f"float8_e4m3fn, dynamic per {'tensor' if per_tensor else 'token'}",
        **({"fp8_scheme": fp8_scheme} if mode == "fp8" else {}),
        "kernel": _kernel_name(mode, model.device, model.dtype, reference, fp8_scheme),
        "original_weights": f"cpu_{str(original_dtype).removeprefix('torch.')}", "restorable": True,
        "nar_prefix_weights": "original (call restore_ar before the NAR stage)",
    }


def none_status() -> dict:
    return {"mode": "none", "source": None, "active_ar_linears": 0, "restorable": False}


def check_proxy_device(mode: str, device: str | torch.device, *, reference: bool = False) -> None:
    """Raise ValueError for an unknown mode, or an FP8 request on a device that cannot run it."""
    if mode not in PROXY_MODES:
        raise ValueError(f"AR proxy mode must be one of {PROXY_MODES}, got {mode!r}")
    if mode == "fp8" and not reference and (reason := fp8_supported(device)) is not None:
        raise ValueError(reason)


def prepare_ar_proxies(model: nn.Module, mode: str, *, reference: bool = False, fp8_scheme: str = "tensor") -> dict:
    """Swap the 7 AR linears per layer for int8 or FP8 proxies; originals go to the CPU, kept exactly.

    Idempotent for the same mode; a different mode needs `restore_ar` first. Proxies are made on
    the model's device; each original module is then moved to the CPU and stored in the plain dict
    `model._yue2_ar_originals` (so `model.to()` leaves it there). `reference` selects FP8's
    dequantising reference (for tests on devices without `_scaled_mm`); `fp8_scheme` is `FP8Linear`'s
    scheme ("tensor": upstream's per-tensor scales, the default; "channel": row-wise). Returns (and
    stores as `model.quantization_status`) the status dict.
    """
    if fp8_scheme not in FP8_SCHEMES:
        raise ValueError(f"fp8_scheme must be one of {FP8_SCHEMES}, got {fp8_scheme!r}")
    layers = _layers(model)
    status = getattr(model, STATUS_ATTR, None) or none_status()
    if status.get("source") == "checkpoint":
        raise ValueError(f"the model was loaded from a {status.get('method')} checkpoint: its AR weights are already "
                         "quantized and no bf16 originals exist; load the bf16 checkpoint for load-time proxies")
    originals = model.__dict__.get(ORIGINALS_ATTR)
    if originals:
        if status.get("mode") == mode:
            return dict(status)
        raise ValueError(f"AR proxies {status.get('mode')!r} are active; "
                         f"call restore_ar(model) before switching to {mode!r}")
    check_proxy_device(mode, model.device, reference=reference)
    for index, layer in enumerate(layers):  # check everything before swapping anything
        for name in AR_LINEARS:
            linear = layer.get_submodule(name)
            if type(linear) is not nn.Linear:
                raise TypeError(f"model.layers.{index}.{name} is {type(linear).__name__}, expected nn.Linear")
            if mode == "fp8" and (linear.in_features % 16 or linear.out_features % 16):
                raise ValueError(f"model.layers.{index}.{name}: FP8 _scaled_mm needs dimensions that are multiples "
                                 f"of 16, got {linear.out_features}x{linear.in_features}")
    originals, original_dtype = {}, None
    model.__dict__[ORIGINALS_ATTR] = originals
    for index, layer in enumerate(layers):
        for name in AR_LINEARS:
            linear = layer.get_submodule(name)
            original_dtype = linear.weight.dtype
            if mode == "int8":
                proxy = Int8Linear.from_linear(linear)
            else:
                proxy = FP8Linear.from_linear(linear, reference=reference, scheme=fp8_scheme)
            _swap(layer, name, proxy)
            originals[f"model.layers.{index}.{name}"] = linear.to("cpu")
    status = _proxy_status(model, mode, len(originals), reference, original_dtype, fp8_scheme)
    setattr(model, STATUS_ATTR, status)
    return dict(status)


def restore_ar(model: nn.Module) -> dict:
    """Put the exact original AR linears back, layer by layer; a no-op when no proxies are active.

    Each layer's originals are moved to the device of the proxy they replace, swapped in, and the
    proxies dropped before the next layer, so the device never holds two full copies.
    """
    layers = _layers(model)
    status = getattr(model, STATUS_ATTR, None) or none_status()
    if status.get("source") == "checkpoint":
        raise ValueError(f"the model was loaded from a {status.get('method')} checkpoint; there are no bf16 "
                         "originals to restore (its NAR prefix prefill runs on the dequantised int8 weights)")
    originals = model.__dict__.get(ORIGINALS_ATTR)
    if not originals:
        setattr(model, STATUS_ATTR, none_status())
        return none_status()
    for index, layer in enumerate(layers):
        for name in AR_LINEARS:
            key = f"model.layers.{index}.{name}"
            proxy = layer.get_submodule(name)
            _swap(layer, name, originals.pop(key).to(proxy.weight.device))
            del proxy
    if originals:
        raise RuntimeError(f"restore_ar: originals left over for {sorted(originals)[:5]}")
    del model.__dict__[ORIGINALS_ATTR]
    setattr(model, STATUS_ATTR, none_status())
    return none_status()


def checkpoint_status(model: nn.Module, quantization_config: dict) -> dict:
    """The status of a model loaded from a `yue2-int8-ar` checkpoint."""
    count = sum(isinstance(m, Int8Linear) for m in _layers(model).modules())
    return {
        "mode": "int8", "source": "checkpoint", "method": INT8_AR_METHOD, "active_ar_linears": count,
        "weight_format": "int8", "weight_scales": "bfloat16 per output channel", "activations": "model dtype",
        "kernel": _kernel_name("int8", model.device, model.dtype), "original_weights": None, "restorable": False,
        "nar_prefix_weights": "dequantised int8 (the checkpoint ships no bf16 AR originals)",
        "source_weights_sha256": quantization_config.get("source_weights_sha256"),
    }


def install_int8_modules(model: nn.Module) -> None:
    """Replace the AR nn.Linear shells of a meta-device model with Int8Linear shells (for loading)."""
    for layer in _layers(model):
        for name in AR_LINEARS:
            linear = layer.get_submodule(name)
            _swap(layer, name, Int8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                          device="meta"))


# --------------------------------------------------------------------------- export


@dataclass(frozen=True)
class ExportReport:
    out_dir: str
    tensors: int
    quantized_linears: int
    payload_bytes: int
    source_weights_sha256: str
    weights_sha256: str

    def to_dict(self) -> dict:
        return asdict(self)


class _QuantizedPair:
    """Quantizes one AR weight on demand and hands out its int8 weight, then its scale (one tensor in memory)."""

    def __init__(self, info: TensorInfo):
        self.info, self.scale = info, None

    def weight(self) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.info.file), framework="pt", device="cpu") as handle:
            q, self.scale = quantize_int8(handle.get_tensor(self.info.name))
        return q

    def weight_scale(self) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError(f"{self.info.name}: scale requested before the weight")
        scale, self.scale = self.scale, None
        return scale


def int8_config(source_config: dict, source_sha256: str) -> dict:
    return {**source_config, "quantization_config": {
        "method": INT8_AR_METHOD, "source_weights_sha256": source_sha256, "bits": 8, "group": "per_output_channel"}}


def export_int8_ar(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                   hashes: HashCache | None = None) -> ExportReport:
    """Write the `yue2-int8-ar` MoT directory for a bf16 YuE2 checkpoint, streamed tensor by tensor.

    The 196 AR linear weights become int8 `<name>.weight` + bf16 `<name>.weight_scale`; every other
    tensor is copied byte for byte. config.json gains `quantization_config`; `qwen.tiktoken` is
    copied. The output directory appears atomically (written under a temporary name).
    """
    from ..tokenizer import TOKENIZER_FILE

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    source_config = read_json(model_file(model_dir, CONFIG_FILE))
    if isinstance(source_config, dict) and "quantization_config" in source_config:
        raise ValueError(f"{model_dir}: config.json already has a quantization_config; "
                         "export needs the bf16 checkpoint")
    config = YuE2Config.load(model_dir)
    infos = weight_index(model_dir)
    check_tensors(infos, checkpoint_layout(config), f"{model_dir}: YuE2 checkpoint does not match config.json")
    if {info.file.name for info in infos.values()} != {SINGLE_FILE}:
        raise CheckpointError(f"{model_dir}: export_int8_ar needs a single {SINGLE_FILE} (the published layout); "
                              "the source_weights_sha256 identity is defined on that file")
    tokenizer = model_file(model_dir, TOKENIZER_FILE)
    source_file = model_file(model_dir, SINGLE_FILE)
    source_sha = (hashes or HashCache(None)).sha256(source_file)
    quantized = {f"{name}.weight" for name in ar_linear_names(config.num_hidden_layers)}

    entries = []
    for info in sorted(infos.values(), key=lambda i: i.start):
        if info.name in quantized:
            pair = _QuantizedPair(info)
            entries.append((info.name, "I8", info.shape, pair.weight))
            entries.append((info.name.removesuffix(".weight") + ".weight_scale", "BF16", info.shape[:1],
                            pair.weight_scale))
        else:
            entries.append((info.name, info.dtype, info.shape, lambda info=info: tensor_blocks(info)))
    metadata = {"format": "pt", "quantization": INT8_AR_METHOD}
    with atomic_directory(out_dir) as tmp:
        weights_sha = write_safetensors_tensors(tmp / SINGLE_FILE, entries, metadata)
        write_json_atomic(tmp / CONFIG_FILE, int8_config(source_config, source_sha))
        shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
    check_tensors(weight_index(out_dir), int8_ar_layout(tensor_shapes(config), config.num_hidden_layers),
                  f"{out_dir}: written int8 checkpoint")
    payload = sum(i.nbytes for i in weight_index(out_dir).values())
    return ExportReport(str(out_dir), len(entries), len(quantized), payload, source_sha, weights_sha)


# --------------------------------------------------------------------------- memory budget


def memory_cap(budget_gib: float, total_bytes: int, reserve_gib: float = 2.0, *, model_bytes: int = 0) -> int:
    """Usable bytes = min(budget − reserve, total − reserve); ValueError if ≤ 0 or below `model_bytes`."""
    if not budget_gib > 0 or total_bytes <= 0 or reserve_gib < 0:
        raise ValueError(f"memory budget {budget_gib} GiB, device total {total_bytes} bytes and reserve "
                         f"{reserve_gib} GiB must be positive")
    reserve = int(reserve_gib * GIB)
    cap = min(int(budget_gib * GIB) - reserve, total_bytes - reserve)
    usable = (f"memory budget {budget_gib:g} GiB on a device of {total_bytes / GIB:.2f} GiB leaves "
              f"{cap / GIB:.2f} GiB usable after the {reserve_gib:g} GiB reserve")
    if cap <= 0:
        raise ValueError(usable + "; raise memory_budget_gib")
    if cap < model_bytes:
        raise ValueError(usable + f", which cannot hold the model's {model_bytes / GIB:.2f} GiB")
    return cap


def device_total_bytes(device: str | torch.device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(cuda_index(device)).total_memory
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        return int(torch.mps.recommended_max_memory())
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def apply_memory_cap(device: str | torch.device, budget_gib: float, model_bytes: int = 0) -> int:
    """Validate the budget for `device`; on CUDA also cap the process via set_per_process_memory_fraction
    on that device's index (a bare `cuda` means the current device; the call refuses an unindexed one)."""
    device = torch.device(device)
    total = device_total_bytes(device)
    cap = memory_cap(budget_gib, total, model_bytes=model_bytes)
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap / total, cuda_index(device))
    return cap


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (originals held in the CPU dict excluded)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
