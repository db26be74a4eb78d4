"""Loading a YuE2 MoT directory: headers validated first, then tensors one at a time into the model.

The layout is a bf16/fp checkpoint's (`modeling.checkpoint_layout`) or, for a `yue2-int8-ar` export,
`torch_quant.int8_ar_layout`; this module is where the two meet, so neither imports the other back.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint import FLOAT_DTYPES, Expected, check_tensors, load_tensors, model_file, read_json, weight_index
from .modeling import CONFIG_FILE, YuE2Config, YuE2Model, assign_tensor, checkpoint_layout, tensor_shapes
from .placement import placement_of, weight_homes
from .torch_quant import (INT8_AR_METHOD, LOAD_MODES, check_proxy_device, checkpoint_method, checkpoint_status,
                          install_int8_modules, int8_ar_layout, none_status, prepare_ar_proxies)


def expected_layout(config: YuE2Config, quantization: str | None = None) -> dict[str, Expected]:
    """Names, shapes and dtypes a checkpoint must hold: bf16/fp weights, or the `yue2-int8-ar` layout
    (the 7·layers AR linears as int8 `weight` + bf16 `weight_scale`)."""
    if quantization is None:
        return checkpoint_layout(config)
    if quantization != INT8_AR_METHOD:
        raise ValueError(f"no checkpoint layout for quantization {quantization!r} (only {INT8_AR_METHOD!r})")
    return int8_ar_layout(tensor_shapes(config), config.num_hidden_layers)


def load_model(model_dir: str | os.PathLike, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.bfloat16, quantization: str = "auto",
               ar_on_device: bool = True) -> YuE2Model:
    """Load a YuE2 MoT directory (config.json + safetensors). Headers are validated first.

    `quant.schemes`:
    * bf16 checkpoint: "auto"/"none" load it as is; "int8"/"fp8" then swap the AR linears for
      load-time proxies (`torch_quant.prepare_ar_proxies`, originals kept on the CPU; call
      `torch_quant.restore_ar` before the NAR stage). "fp8" is refused up front on a device
      without FP8 `_scaled_mm` (CUDA compute capability >= 8.9).
    * `yue2-int8-ar` checkpoint: "auto"/"int8" build `Int8Linear` for the AR linears (the int8
      weights and bf16 scales are kept as stored, whatever `dtype`); "none"/"fp8" raise ValueError.
    `model.quantization_status` records what is active.
    `ar_on_device=False` (a bf16 checkpoint on a GPU beside the engine, which holds the AR weights): the AR
    expert (`placement.weight_homes`) is loaded into pinned host memory instead, once; the rest on `device`.
    `placement.placement_of(model)` owns where it lives from then on.
    """
    if quantization not in LOAD_MODES:
        raise ValueError(f"quantization must be one of {LOAD_MODES}, got {quantization!r}")
    model_dir = Path(model_dir)
    path = model_file(model_dir, CONFIG_FILE)
    raw = read_json(path)
    try:
        method = checkpoint_method(raw, str(path)) if isinstance(raw, dict) else None
        config = YuE2Config.from_dict({k: v for k, v in raw.items() if k != "quantization_config"}
                                      if isinstance(raw, dict) else raw)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None
    if method == INT8_AR_METHOD and quantization in ("none", "fp8"):
        raise ValueError(
            f"{model_dir}: the checkpoint is quantized (quantization_config.method {method!r}: int8 AR weights, no "
            f"bf16 originals), so quantization={quantization!r} is impossible; use 'auto' or 'int8', or load the "
            "bf16 source checkpoint for 'none'/'fp8'")
    if method is None and quantization in ("int8", "fp8"):
        check_proxy_device(quantization, device)
    infos = weight_index(model_dir)
    layout = expected_layout(config, method)
    check_tensors(infos, layout, f"{model_dir}: YuE2 checkpoint does not match config.json")
    with torch.device("meta"):
        model = YuE2Model(config)
    if method is not None:
        install_int8_modules(model)
    stored = {name for name, want in layout.items() if want.dtypes != FLOAT_DTYPES}  # int8 weights, bf16 scales
    cast = [info for name, info in infos.items() if name not in stored]
    kept = [infos[name] for name in stored]
    kind = torch.device(device).type  # the AR expert goes to host memory only from an accelerator (bf16 weights)
    pinned = kind == "cuda"
    resident = ar_on_device or kind == "cpu" or method is not None or quantization in ("int8", "fp8")  # proxies
    host = {name for name, home in weight_homes(config, resident).items() if home == "host"}
    for name, tensor in load_tensors([info for info in cast if info.name not in host], device=device, dtype=dtype):
        assign_tensor(model, name, tensor)
    for name, tensor in load_tensors([info for info in cast if info.name in host], device="cpu", dtype=dtype):
        assign_tensor(model, name, tensor.pin_memory() if pinned else tensor)
    for name, tensor in load_tensors(kept, device=device):
        assign_tensor(model, name, tensor)
    model = model.eval().requires_grad_(False)
    placement_of(model)  # its owner from now on: the AR expert's home is where it was just put
    if method is not None:
        model.quantization_status = checkpoint_status(model, raw["quantization_config"])
    elif quantization in ("int8", "fp8"):
        prepare_ar_proxies(model, quantization)
    else:
        model.quantization_status = none_status()
    return model
