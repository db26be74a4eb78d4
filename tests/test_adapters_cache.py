"""The conversion cache: once per content, the AR part as vLLM's PEFT loader reads it, the rest for torch."""
import json
import os

import pytest
import torch

from yue2_vllm.adapters.cache import AR_DIR, NAR_FILE, RECORD, content_sha256, convert_adapter
from yue2_vllm.adapters.weights import AdapterError
from yue2_vllm.checkpoint import read_header, sha256_file
from yue2_vllm.model.lora import applied, merged
from yue2_vllm.model.modeling import YuE2Config
from yue2_vllm.peft_format import CONFIG as PEFT_CONFIG
from yue2_vllm.peft_format import WEIGHTS as PEFT_WEIGHTS
from yue2_vllm.testing import TINY_CONFIG, random_model
from yue2_vllm.testing_adapters import write_tiny_adapter


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def test_a_conversion_and_its_record(tmp_path, cache):
    tiny = write_tiny_adapter(tmp_path / "a.safetensors", "comfyui", half="both", rank=4, alpha=12)
    converted = convert_adapter(tiny.path, TINY_CONFIG, cache_dir=cache)
    record = json.loads((converted.directory / RECORD).read_text())
    assert record["sha256"] == sha256_file(tiny.path) == converted.sha256  # one file: its own sha256
    assert record["layout"] == "comfyui" and record["summary"]["half"] == "both"
    assert record["ar"]["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                              "v_proj"]
    assert record["ar"]["max_lora_rank"] == 8 and record["nar"]["deltas"] == 2
    assert any("fused" in note for note in record["notes"])
    config = json.loads((converted.ar_path / PEFT_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"], config["bias"]) == (4, 4, "LORA", "none")
    keys, _ = read_header(converted.ar_path / PEFT_WEIGHTS)
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight" in keys and len(keys) == 28
    assert all(".nar_" not in key for key in keys)
    nar_keys, _ = read_header(converted.directory / NAR_FILE)
    assert {"vae2llm.diff", "vae2llm.diff_b", "model.layers.0.nar_mlp.up_proj.lora_A"} <= set(nar_keys)
    assert record["outputs"][f"{AR_DIR}/{PEFT_WEIGHTS}"] == sha256_file(converted.ar_path / PEFT_WEIGHTS)


def test_the_cache_is_content_addressed_and_reused(tmp_path, cache):
    first = write_tiny_adapter(tmp_path / "one" / "a.safetensors", "plain", seed=1)
    second = write_tiny_adapter(tmp_path / "two" / "a.safetensors", "plain", seed=1)
    one = convert_adapter(first.path, TINY_CONFIG, cache_dir=cache)
    stamp = (one.ar_path / PEFT_WEIGHTS).stat().st_mtime_ns
    assert convert_adapter(second.path, TINY_CONFIG, cache_dir=cache).directory == one.directory
    assert (one.ar_path / PEFT_WEIGHTS).stat().st_mtime_ns == stamp
    other = YuE2Config(**{**TINY_CONFIG.__dict__, "rope_theta": 10000.0})
    assert convert_adapter(first.path, other, cache_dir=cache).directory != one.directory
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == sorted(
        {one.directory.name, convert_adapter(first.path, other, cache_dir=cache).directory.name})


def test_a_damaged_entry_is_named(tmp_path, cache):
    tiny = write_tiny_adapter(tmp_path / "a.safetensors", "plain")
    converted = convert_adapter(tiny.path, TINY_CONFIG, cache_dir=cache)
    weights = converted.ar_path / PEFT_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    os.chmod(weights, 0o644)
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterError, match=f"corrupt adapter cache: {weights} does not match its sha256.*delete"):
        convert_adapter(tiny.path, TINY_CONFIG, cache_dir=cache)


def test_a_bad_adapter_leaves_nothing_behind(tmp_path, cache):
    tiny = write_tiny_adapter(tmp_path / "a.safetensors", "plain", rank=16)
    with pytest.raises(AdapterError, match="above the limit 8"):
        convert_adapter(tiny.path, TINY_CONFIG, cache_dir=cache, max_rank=8)
    assert [p for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_scale_is_vllms_lora_alpha_beside_the_same_tensors(tmp_path, cache):
    converted = convert_adapter(write_tiny_adapter(tmp_path / "a", "peft", rank=4).path, TINY_CONFIG, cache_dir=cache)
    assert converted.ar_directory(1.0) == converted.ar_path
    half = converted.ar_directory(0.5)
    assert json.loads((half / PEFT_CONFIG).read_text())["lora_alpha"] == 2.0
    assert (half / PEFT_WEIGHTS).stat().st_ino == (converted.ar_path / PEFT_WEIGHTS).stat().st_ino
    assert converted.ar_directory(0.5) == half
    nar_only = convert_adapter(write_tiny_adapter(tmp_path / "n", "peft", half="nar").path, TINY_CONFIG,
                               cache_dir=cache)
    with pytest.raises(AdapterError, match="has no AR part"):
        nar_only.ar_directory()


def test_the_torch_edits_equal_the_truth(tmp_path, cache):
    model = random_model().float()
    ids = torch.tensor([[151643, 5, 6, 7, 8]])
    tiny = write_tiny_adapter(tmp_path / "a", "peft-rslora", half="both", rank=4, alpha=6)
    converted = convert_adapter(tiny.path, TINY_CONFIG, cache_dir=cache)
    edits = converted.edits(0.7)
    assert set(edits) == set(tiny.edits)
    assert set(converted.edits(0.7, half="ar")) == {m for m in tiny.edits if ".nar_" not in m}
    with applied(model, edits):
        run_time = model.forward_ar(ids, logits_to_keep=0)
    with merged(model, {m: e for m, e in tiny.scaled(0.7).items() if ".nar_" not in m}):
        reference = model.forward_ar(ids, logits_to_keep=0)
    torch.testing.assert_close(run_time, reference, rtol=0, atol=2e-5)
    assert converted.tensor_bytes("ar") > 0 and converted.tensor_bytes() > converted.tensor_bytes("ar")


def test_replacements_convert_for_the_torch_side(tmp_path, cache):
    tiny = write_tiny_adapter(tmp_path / "n.safetensors", "plain", half="nar")
    converted = convert_adapter(tiny.path, TINY_CONFIG, cache_dir=cache)
    assert converted.record.nar.replacements == 2 and converted.ar_path is None
    edits = converted.edits()
    assert torch.equal(edits["vae2llm"][0].weight.float(), tiny.edits["vae2llm"][0].weight)


def test_a_multi_file_adapter_hashes_its_names_and_contents(tmp_path, cache):
    tiny = write_tiny_adapter(tmp_path / "a", "alpha-rank")
    converted = convert_adapter(tiny.path, TINY_CONFIG, cache_dir=cache)
    files = converted.record.files
    assert set(files) == {"lora.safetensors", "adapter_config.json"}
    assert converted.sha256 == content_sha256(files) and len(converted.sha256) == 64


def test_vllm_reads_the_converted_directory_as_the_truth(tmp_path, cache):
    """vLLM's own PEFT loader (no engine): the factors it would put in its slots are ours, scale included."""
    pytest.importorskip("vllm")
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    tiny = write_tiny_adapter(tmp_path / "a.safetensors", "comfyui", half="both", rank=4, alpha=12)
    converted = convert_adapter(tiny.path, TINY_CONFIG, cache_dir=cache)
    directory = converted.ar_directory(0.5)
    helper = PEFTHelper.from_local_dir(str(directory), None)
    loaded = LoRAModel.from_local_checkpoint(str(directory), {"qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                                              "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"},
                                             helper, lora_model_id=1, device="cpu", dtype=torch.float32)
    truth = tiny.scaled(0.5)
    ar = {m: e[0] for m, e in truth.items() if ".nar_" not in m and m.startswith("model.layers.")}
    assert set(loaded.loras) == set(ar)
    for module, edit in ar.items():
        lora = loaded.loras[module].optimize()
        torch.testing.assert_close(lora.lora_b @ lora.lora_a, edit.scale * edit.b @ edit.a, rtol=1e-6, atol=1e-6)
