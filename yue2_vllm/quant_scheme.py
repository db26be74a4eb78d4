"""The quantized-AR scheme table: what a compressed-tensors `quantization_config` describes (`QuantScheme`,
parsed by `parse_quantization`) and the tensor names it adds (`QUANT_SUFFIXES`).

On the floor because both sides read it: `derive` validates an AR checkpoint's tensors against its scheme,
and `quant/` (where each scheme runs, and fast; the exports) judges and writes schemes.
"""
from __future__ import annotations

from dataclasses import dataclass

# Tensor-name suffixes compressed-tensors adds beside (or instead of) a quantized linear's weight.
QUANT_SUFFIXES = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_packed", "weight_shape",
                  "input_scale", "input_zero_point", "weight_global_scale", "input_global_scale")


@dataclass(frozen=True)
class QuantScheme:
    """A compressed-tensors scheme in the terms that decide whether vLLM can run it."""

    name: str  # e.g. "W8A8-FP8", "W8A8-INT8", "W8A16-INT8", "W4A16"
    format: str
    weight_type: str  # "float" | "int"
    weight_bits: int
    weight_strategy: str
    activation_bits: int | None  # None: weight-only
    activation_dynamic: bool | None
    activation_strategy: str | None
    ignore: tuple[str, ...]
    activation_symmetric: bool | None = None  # None: weight-only (compressed-tensors' default is symmetric)

    def to_dict(self) -> dict:
        return {"name": self.name, "format": self.format, "weights": f"{self.weight_type}{self.weight_bits}/"
                f"{self.weight_strategy}", "activations": None if self.activation_bits is None else
                f"{self.activation_bits}bit/{'dynamic' if self.activation_dynamic else 'static'}/"
                f"{self.activation_strategy}", "ignore": list(self.ignore)}


def parse_quantization(config: dict) -> QuantScheme | None:
    """The scheme of a Qwen3 `config.json`, None for an unquantized checkpoint; unknown forms raise ValueError."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (only compressed-tensors)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups: expected one group, found {len(groups)}")
    (group,) = groups.values()
    weights, activations = group.get("weights") or {}, group.get("input_activations")
    if not weights:
        raise ValueError("quantization_config.config_groups: the group has no 'weights' scheme")
    if "Linear" not in (group.get("targets") or []):
        raise ValueError(f"quantization_config: targets {group.get('targets')} do not include 'Linear'")
    weight_type, weight_bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
    act_bits = int(activations["num_bits"]) if activations else None
    prefix = "W4A16" if weight_bits == 4 and act_bits is None else f"W{weight_bits}A{act_bits or 16}"
    suffix = "-FP8" if weight_type == "float" and weight_bits == 8 else ("-INT8" if weight_bits == 8 else "")
    return QuantScheme(
        name=prefix + suffix, format=group.get("format") or qc.get("format", ""), weight_type=weight_type,
        weight_bits=weight_bits, weight_strategy=weights.get("strategy", "tensor"), activation_bits=act_bits,
        activation_dynamic=bool(activations.get("dynamic")) if activations else None,
        activation_strategy=activations.get("strategy") if activations else None,
        ignore=tuple(qc.get("ignore") or ()),
        activation_symmetric=bool(activations.get("symmetric", True)) if activations else None,
    )
