"""Which AR checkpoint the engine serves: an override validated, a quantized one served or declined as the
quantized policy says, else the derived bf16 checkpoint."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from yue2_vllm.derive import DerivationError, derive_ar_checkpoint
from yue2_vllm.quant.policy import resolve_ar_checkpoint

PUBLISHED_FP8 = Path(__file__).parent / "data" / "published-fp8-config.json"  # DKmode22/YuE2-3B-FP8


@pytest.fixture(scope="module")
def derived(tiny_model_dir, tmp_path_factory):
    return derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))


def test_override_copy_is_accepted_and_mismatch_refused(derived, tiny_model_dir, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(derived, copy)
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(copy))
    resolved = resolve_ar_checkpoint(tiny_model_dir)
    assert resolved.path == copy.resolve() and resolved.source == "override" and resolved.unservable is None
    config = json.loads((copy / "config.json").read_text())
    config["num_key_value_heads"] = 4
    config["architectures"] = ["LlamaForCausalLM"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(DerivationError) as info:
        resolve_ar_checkpoint(tiny_model_dir)
    assert "num_key_value_heads is 4, the MoT has 2" in str(info.value)
    assert "architectures ['LlamaForCausalLM']" in str(info.value)
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(tmp_path / "absent"))
    with pytest.raises(DerivationError, match="not a directory"):
        resolve_ar_checkpoint(tiny_model_dir)


def fp8_override(derived: Path, directory: Path) -> Path:
    """The derived checkpoint as the published FP8 export lays it out: every *_proj weight float8 with its
    per-channel scale, lm_head kept (ignored), the published quantization_config."""
    shutil.copytree(derived, directory)
    state = load_file(str(directory / "model.safetensors"))
    for name in [name for name in state if name.endswith("_proj.weight")]:
        state[name] = state[name].to(torch.float8_e4m3fn)
        state[name.replace(".weight", ".weight_scale")] = torch.ones(state[name].shape[0], 1, dtype=torch.bfloat16)
    save_file(state, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = json.loads(PUBLISHED_FP8.read_text())["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_slow_quantized_override_is_declined_unless_forced(derived, tiny_model_dir, tmp_path, monkeypatch):
    """FP8 W8A8 decodes 42x slower than bf16 on vLLM-CPU (quant.schemes.slow_reason): `auto` serves the
    derived checkpoint and says why, `force` serves the override and records it as slow."""
    monkeypatch.delenv("YUE2_AR_CHECKPOINT", raising=False)
    override = fp8_override(derived, tmp_path / "fp8")
    auto = resolve_ar_checkpoint(tiny_model_dir, override=override, cache_dir=tmp_path / "cache")
    assert (auto.source, auto.quantization, auto.slow) == ("derived", None, None)
    assert auto.declined.startswith(f"{override.resolve()}: W8A8-FP8 runs through torch._scaled_mm on CPU")
    assert auto.declined.endswith("; serving the bf16 derived checkpoint (quantized_policy 'force' serves it anyway)")
    forced = resolve_ar_checkpoint(tiny_model_dir, override=override, quantized_policy="force")
    assert (forced.path, forced.source, forced.quantization.name) == (override.resolve(), "override", "W8A8-FP8")
    assert "42x slower than bf16" in forced.slow and forced.declined is None and forced.unservable is None
    # on a GPU (torch.cuda patched: none here): Hopper has the FP8 kernel, Ampere does not
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))
    hopper = resolve_ar_checkpoint(tiny_model_dir, override=override, device_type="cuda")
    assert (hopper.source, hopper.slow, hopper.declined) == ("override", None, None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (8, 0))
    ampere = resolve_ar_checkpoint(tiny_model_dir, override=override, device_type="cuda", cache_dir=tmp_path / "cache")
    assert ampere.source == "derived" and "W8A8-FP8 has no fast vLLM kernel on CUDA sm80" in ampere.declined
    with pytest.raises(ValueError, match=r"quantized_policy must be one of \('auto', 'force'\), got 'always'"):
        resolve_ar_checkpoint(tiny_model_dir, override=override, quantized_policy="always")
