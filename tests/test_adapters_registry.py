"""Named adapters: registration converts and checks first; requests name adapters and scales."""
import json

import pytest

from yue2_vllm.adapters.registry import (AdapterRegistry, LoraSpec, UnknownAdapter, check_scale, parse_lora_module,
                                         parse_lora_spec, resolve_adapter_path)
from yue2_vllm.adapters.weights import AdapterError
from yue2_vllm.hub import HubError
from yue2_vllm.protocol import AdapterRef, adapter_refs
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.testing_adapters import write_tiny_adapter


@pytest.fixture
def registry(tmp_path):
    return AdapterRegistry(TINY_CONFIG, cache_dir=tmp_path / "cache")


def test_lora_specs():
    assert parse_lora_spec("runs/a.safetensors") == LoraSpec("runs/a.safetensors", 1.0)
    assert parse_lora_spec("runs/a.safetensors:0.5") == LoraSpec("runs/a.safetensors", 0.5)
    assert parse_lora_spec("Mothersuperior/YuE2-instrumental-cot-full-loras:-1") == LoraSpec(
        "Mothersuperior/YuE2-instrumental-cot-full-loras", -1.0)
    assert parse_lora_spec("dir:with:colons") == LoraSpec("dir:with:colons", 1.0)
    with pytest.raises(AdapterError, match=r"--lora a:11: 11.0 is not a number in \[-10, 10\]"):
        parse_lora_spec("a:11")
    with pytest.raises(AdapterError, match="nan"):
        parse_lora_spec("a:nan")


def test_lora_modules_as_vllm_spells_them():
    assert parse_lora_module("inst=/m/a.safetensors") == ("inst", "/m/a.safetensors")
    assert parse_lora_module(json.dumps({"name": "inst", "path": "/m/a", "base_model_name": "x"})) == ("inst", "/m/a")
    for bad in ("inst", "=x", "inst=", '{"name": 1}', "{nope"):
        with pytest.raises(AdapterError, match="--lora-modules"):
            parse_lora_module(bad)


def test_scales():
    assert check_scale(0) == 0.0 and check_scale(-2) == -2.0
    for bad in (True, "1", float("inf"), 10.5, None):
        with pytest.raises(AdapterError, match="adapters\\[0\\].scale"):
            check_scale(bad, "adapters[0].scale")


def test_register_list_and_use(tmp_path, registry):
    (tmp_path / "inst").mkdir()
    (tmp_path / "inst" / "README.md").write_text("---\nlicense: cc-by-nc-4.0\n---\n")
    write_tiny_adapter(tmp_path / "inst" / "ar_lora_inst.safetensors", "plain", rank=8)
    nar = write_tiny_adapter(tmp_path / "nar", "peft", half="nar")
    inst = registry.register("instrumental", tmp_path / "inst")
    registry.register("voice", nar.path)
    assert [a.name for a in registry.adapters()] == ["instrumental", "voice"] and len(registry) == 2
    info = inst.info()
    assert (info["half"], info["rank"], info["layout"], info["licence"]) == ("ar", 8, "plain", "cc-by-nc-4.0")
    assert info["sha256"] == inst.sha256 and "self_attn.q_proj" in info["modules"]
    uses = registry.uses(adapter_refs([{"name": "instrumental"}, {"name": "voice", "scale": 0.5},
                                       {"name": "voice", "scale": 0}]))
    assert [(u.adapter.name, u.scale) for u in uses] == [("instrumental", 1.0), ("voice", 0.5)]
    assert uses[1].identity() == {"sha256": registry.get("voice").sha256, "scale": 0.5}
    assert uses[0].record() == {"name": "instrumental", "half": "ar", "sha256": inst.sha256, "scale": 1.0, "rank": 8,
                                "layout": "plain", "licence": "cc-by-nc-4.0"}
    assert uses[1].ref == AdapterRef("voice", 0.5)


def test_unknown_names_and_bad_entries_are_named(registry, tmp_path):
    registry.register("a", write_tiny_adapter(tmp_path / "a.safetensors", "plain").path)
    with pytest.raises(UnknownAdapter, match=r"unknown adapter 'nope' \(registered: a\)"):
        registry.uses([AdapterRef("nope")])
    # names and scales are checked once, where a request's AdapterRefs are made (protocol.adapter_refs)
    with pytest.raises(ValueError, match=r"adapters\[0\]: needs a name"):
        adapter_refs([{"scale": 1}], "adapters")
    with pytest.raises(ValueError, match=r"adapters\[1\]: adapter a scale: 20 is not a number"):
        adapter_refs([{"name": "a"}, {"name": "a", "scale": 20}], "adapters")


def test_a_failed_registration_changes_nothing(registry, tmp_path):
    good = write_tiny_adapter(tmp_path / "a.safetensors", "plain", seed=1)
    registry.register("a", good.path)
    bad = write_tiny_adapter(tmp_path / "lokr.safetensors", "lokr")
    with pytest.raises(AdapterError, match="LoKr"):
        registry.register("b", bad.path)
    other = write_tiny_adapter(tmp_path / "other.safetensors", "plain", seed=2)
    with pytest.raises(AdapterError, match="already registered"):
        registry.register("a", other.path)
    with pytest.raises(AdapterError, match="adapter name 'has space'"):
        registry.register("has space", good.path)
    assert [a.name for a in registry.adapters()] == ["a"] and registry.get("a").source == str(good.path)
    registry.register("a", good.path)  # the same content again is fine


def test_specs_register_under_their_stems(registry, tmp_path):
    first = write_tiny_adapter(tmp_path / "x" / "style.safetensors", "plain", seed=1)
    second = write_tiny_adapter(tmp_path / "y" / "style.safetensors", "plain", seed=2)
    uses = registry.register_specs([LoraSpec(str(first.path), 0.5), LoraSpec(str(second.path))])
    assert [(u.adapter.name, u.scale) for u in uses] == [("style", 0.5), ("style-2", 1.0)]


def test_hub_ids_resolve_through_the_hub_cache(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    with pytest.raises(HubError, match="adapter Mothersuperior/YuE2-instrumental-cot-full-loras .*not in the Hugging"):
        resolve_adapter_path("Mothersuperior/YuE2-instrumental-cot-full-loras/ar_lora_inst_v3abc.bf16.safetensors",
                             env=env)
    local = tmp_path / "a.safetensors"
    assert resolve_adapter_path(str(local), env=env) == local
    assert resolve_adapter_path("./x/y", env=env).name == "y"
