"""Adapters on the torch MoT: low-rank deltas, additive deltas and replacement weights per linear.

Two ways to apply a song's edits, both leaving the resident base weights bit-exact afterwards:

* **At run time** (`applied`, what the stages use): a forward hook on each edited linear adds the edit's
  output to the base output, for the rows the edit owns. The weights are never written, so removal is
  exact by construction, songs with different adapters can share one batched call (`Segment`: each song's
  rows get its own edits, rows without an adapter get none) and concurrent stages on one model do not see
  each other's adapters: the active edits live in a context variable, which every thread has its own of.
  A low-rank edit adds `scale · B(Ax)` (in bf16 on a bf16 model, the scale folded into B as vLLM's GPU path
  has it; in float32 otherwise); a module with an additive or replacement edit instead gets its effective weight
  `W + …` computed once per activation, so its output equals the merged model's exactly.
* **Merged** (`merged`, the reference the tests and tools compare with): the effective weights are put in
  place of the parameters and the original parameter objects are put back on exit.

The effective weight of a list of edits (`effective_weights`, float32 then cast back): replacements first,
`W + s·(R − W)` (`R` itself at s = 1), then every additive `W + s·D` and low-rank `W + s·B@A` in order.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, eq=False)
class LowRank:
    """`W += scale · b @ a`: `a [rank, in]`, `b [out, rank]`."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float = 1.0

    def __post_init__(self):
        if self.a.ndim != 2 or self.b.ndim != 2 or self.a.shape[0] != self.b.shape[1]:
            raise ValueError(f"low-rank factors must be a [rank, in] and b [out, rank], got a {list(self.a.shape)} "
                             f"and b {list(self.b.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.b.shape[0], self.a.shape[1]


@dataclass(frozen=True, eq=False)
class Additive:
    """`W += scale · weight`, `bias += scale · bias` (ComfyUI's `.diff` / `.diff_b`); either may be None."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    scale: float = 1.0


@dataclass(frozen=True, eq=False)
class Replacement:
    """`W = W + strength · (weight − W)` (and the bias alike): the full tensor at strength 1."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    strength: float = 1.0


Edit = LowRank | Additive | Replacement
Edits = Mapping[str, Sequence[Edit]]  # module name (as in the checkpoint, without ".weight") -> its edits


def _merge(current: torch.Tensor, edits: Sequence[Edit], part: str) -> torch.Tensor:
    """`current` (float32) with every edit's contribution to `part` ("weight" or "bias")."""
    for edit in sorted(edits, key=lambda e: not isinstance(e, Replacement)):
        if isinstance(edit, Replacement):
            target = getattr(edit, part)
            if target is None:
                continue
            target = target.to(current.device, torch.float32)
            current = target.clone() if edit.strength == 1 else current + edit.strength * (target - current)
        elif isinstance(edit, Additive):
            delta = getattr(edit, part)
            if delta is not None:
                current = current + edit.scale * delta.to(current.device, torch.float32)
        elif part == "weight":
            product = edit.b.to(current.device, torch.float32) @ edit.a.to(current.device, torch.float32)
            current = current + (product if edit.scale == 1 else edit.scale * product)
    return current


def effective_weights(weight: torch.Tensor, bias: torch.Tensor | None, edits: Sequence[Edit]) \
        -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias a linear has with `edits` merged in (computed in float32, cast to their dtype)."""
    if not weight.is_floating_point() or weight.dtype.itemsize < 2:
        raise TypeError(f"cannot merge an edit into a {weight.dtype} weight (a quantized proxy): merge into the "
                        "bf16 original, or apply the edit at run time")
    merged_weight = _merge(weight.float(), edits, "weight").to(weight.dtype)
    if bias is None:
        if any(getattr(edit, "bias", None) is not None for edit in edits):
            raise ValueError("an edit carries a bias for a linear that has none")
        return merged_weight, None
    return merged_weight, _merge(bias.float(), edits, "bias").to(bias.dtype)


def _linear(model: nn.Module, name: str) -> nn.Module:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise KeyError(f"the model has no module {name!r}") from None
    if not hasattr(module, "in_features") or not hasattr(module, "out_features"):
        raise TypeError(f"{name} is {type(module).__name__}, not a linear layer")
    return module


def check_edits(model: nn.Module, edits: Edits) -> None:
    """Every edited module exists, is a linear, and every edit has its shape (ValueError naming the first that is
    not)."""
    for name, module_edits in edits.items():
        module = _linear(model, name)
        shape = (module.out_features, module.in_features)
        for edit in module_edits:
            found = edit.shape if isinstance(edit, LowRank) else tuple(edit.weight.shape) \
                if edit.weight is not None else shape
            if tuple(found) != shape:
                raise ValueError(f"{name}: an edit of shape {list(found)} for a {list(shape)} weight")
            if not isinstance(edit, LowRank) and edit.bias is not None and tuple(edit.bias.shape) != shape[:1]:
                raise ValueError(f"{name}: a bias edit of shape {list(edit.bias.shape)} for [{shape[0]}]")


# --------------------------------------------------------------------------- at run time


@dataclass(frozen=True)
class Segment:
    """Rows `[start, end)` of a call's flattened tokens (`x.reshape(-1, in)`) that get `edits`; `None` bounds
    mean every row."""

    edits: Edits
    start: int | None = None
    end: int | None = None


@dataclass
class _Activation:
    root: weakref.ref
    segments: dict[str, list[tuple[int | None, int | None, tuple[Edit, ...]]]]
    cache: dict = field(default_factory=dict)  # (edits id, device, dtype) -> factors or effective weights


_ACTIVE: contextvars.ContextVar[_Activation | None] = contextvars.ContextVar("yue2_lora_active", default=None)
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
_HOOK_LOCK = threading.Lock()


def _factors(activation: _Activation, edit: LowRank, device: torch.device, dtype: torch.dtype):
    """The edit's factors on the device, in the compute dtype (float32 for float32 and float16 outputs, else the
    output's: bf16 as vLLM's GPU kernels take them), the scale folded into B there (as vLLM folds it)."""
    key = (id(edit), device, dtype)
    found = activation.cache.get(key)
    if found is None:
        b = edit.b.to(device, dtype)
        found = activation.cache[key] = (edit.a.to(device, dtype), b if edit.scale == 1 else edit.scale * b)
    return found


def _weights(activation: _Activation, module: nn.Module, edits: tuple[Edit, ...]):
    key = (tuple(map(id, edits)), id(module), module.weight.device)
    found = activation.cache.get(key)
    if found is None:
        found = activation.cache[key] = effective_weights(module.weight, getattr(module, "bias", None), edits)
    return found


def _hook_for(name: str, root: nn.Module):
    root_ref = weakref.ref(root)

    def hook(module: nn.Module, args, output: torch.Tensor):
        activation = _ACTIVE.get()
        if activation is None or activation.root() is not root_ref():
            return None
        segments = activation.segments.get(name)
        if not segments:
            return None
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        flat = output.reshape(-1, output.shape[-1])
        for start, end, edits in segments:
            part = slice(start, end)
            if all(isinstance(edit, LowRank) for edit in edits):
                dtype = torch.bfloat16 if flat.dtype == torch.bfloat16 else torch.float32
                delta = None
                for edit in edits:
                    a, b = _factors(activation, edit, rows.device, dtype)
                    term = (rows[part].to(dtype) @ a.T) @ b.T
                    delta = term if delta is None else delta + term
                flat[part] += delta.to(flat.dtype)
            else:
                weight, bias = _weights(activation, module, edits)
                flat[part] = F.linear(rows[part], weight, bias)
        return flat.view(output.shape)

    return hook


def _install(model: nn.Module, names) -> None:
    with _HOOK_LOCK:
        for name in names:
            module = _linear(model, name)
            if _HOOKED.get(module) != name:
                module.register_forward_hook(_hook_for(name, model))
                _HOOKED[module] = name


@contextlib.contextmanager
def applied(model: nn.Module, edits: Edits | Sequence[Segment] | None) -> Iterator[None]:
    """Run the model with `edits` (one song's, on every row) or `Segment`s (rows of several songs in one call)
    in this thread's context; nothing is written into the model. `None` or no edits: the base model (an outer
    activation is hidden for the duration)."""
    segments = [] if not edits else [Segment(edits)] if isinstance(edits, Mapping) else list(edits)
    plan: dict[str, list] = {}
    for segment in segments:
        check_edits(model, segment.edits)
        for name, module_edits in segment.edits.items():
            if module_edits:
                plan.setdefault(name, []).append((segment.start, segment.end, tuple(module_edits)))
    _install(model, plan)
    token = _ACTIVE.set(_Activation(weakref.ref(model), plan) if plan else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """Whether edits are active in this context (a captured CUDA graph must not mix activations)."""
    return _ACTIVE.get() is not None


# --------------------------------------------------------------------------- merged


@contextlib.contextmanager
def merged(model: nn.Module, edits: Edits) -> Iterator[None]:
    """The model with `edits` merged into its weights for the block; the very parameter objects it had are put back
    afterwards (bit-exact, also on errors). Not for a model other threads run meanwhile."""
    check_edits(model, edits)
    saved = []
    try:
        for name, module_edits in edits.items():
            module = _linear(model, name)
            bias = getattr(module, "bias", None)
            weight, new_bias = effective_weights(module.weight, bias, module_edits)
            saved.append((module, module._parameters["weight"], module._parameters.get("bias")))
            module._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                module._parameters["bias"] = nn.Parameter(new_bias, requires_grad=False)
        yield
    finally:
        for module, weight, bias in reversed(saved):
            module._parameters["weight"] = weight
            if bias is not None:
                module._parameters["bias"] = bias


def merge_state_dict(state: Mapping[str, torch.Tensor], edits: Edits) -> dict[str, torch.Tensor]:
    """A copy of a checkpoint's tensors (`<module>.weight`, `<module>.bias`) with `edits` merged in (a merged
    checkpoint to compare the run-time path with)."""
    out = dict(state)
    for name, module_edits in edits.items():
        if f"{name}.weight" not in state:
            raise KeyError(f"the checkpoint has no {name}.weight")
        out[f"{name}.weight"], bias = effective_weights(state[f"{name}.weight"], state.get(f"{name}.bias"),
                                                        module_edits)
        if bias is not None:
            out[f"{name}.bias"] = bias
    return out
