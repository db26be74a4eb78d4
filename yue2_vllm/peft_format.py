"""PEFT's LoRA directory, as PEFT writes it and vLLM's LoRA loader reads it (lora/peft_helper.py, lora/utils.py):
its file names and the names of its tensors. One home for them: adapters/ reads users' PEFT directories and
writes the converted AR part in this form, the engine checks that form before vLLM loads it, and the tiny test
adapters mimic it."""
from __future__ import annotations

CONFIG = "adapter_config.json"  # r, lora_alpha, target_modules, ... (vLLM's PEFTHelper reads it)
WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PEFT's wrapper prefix on every tensor name (vLLM strips it)
REQUIRED = ("r", "lora_alpha", "target_modules")  # the config fields vLLM's loader refuses to do without


def lora_keys(module: str) -> tuple[str, str]:
    """The names PEFT stores a module's factors under: `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`."""
    return f"{KEY_PREFIX}{module}.lora_A.weight", f"{KEY_PREFIX}{module}.lora_B.weight"


def module_of(key: str) -> str | None:
    """The module of a `lora_A` key (`lora_keys`' first), None for any other key."""
    suffix = ".lora_A.weight"
    return key[len(KEY_PREFIX):-len(suffix)] if key.startswith(KEY_PREFIX) and key.endswith(suffix) else None
