"""Every layout users bring reads into the same normalized adapter: the factors as stored, the layout's scale."""
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from yue2_vllm.adapters.layouts import layout_name, locate, read_adapter, read_card
from yue2_vllm.adapters.weights import AdapterError, Diff, Full, Pair
from yue2_vllm.model.lora import Additive, LowRank
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.testing_adapters import LAYOUTS, write_tiny_adapter

FILE_LAYOUTS = ("plain", "comfyui", "slider-distill")
CASES = [(layout, half) for layout in LAYOUTS for half in (("ar",) if layout == "slider-distill" else
                                                           ("ar", "nar", "both"))]


def where(tmp_path, layout, name="adapter"):
    return tmp_path / (f"{name}.safetensors" if layout in FILE_LAYOUTS else name)


def same(change, truth) -> bool:
    if isinstance(truth, LowRank):
        return isinstance(change, Pair) and torch.equal(change.a.float(), truth.a) \
            and torch.equal(change.b.float(), truth.b) and change.scale == truth.scale
    kind = Diff if isinstance(truth, Additive) else Full
    return isinstance(change, kind) and torch.equal(change.weight.float(), truth.weight) \
        and torch.equal(change.bias.float(), truth.bias)


@pytest.mark.parametrize("layout, half", CASES)
def test_every_layout_reads_as_its_truth(tmp_path, layout, half):
    tiny = write_tiny_adapter(where(tmp_path, layout), layout, half=half, seed=4)
    adapter = read_adapter(tiny.path, TINY_CONFIG)
    assert adapter.layout == tiny.layout
    assert set(adapter.modules) == set(tiny.edits)
    assert all(same(adapter.modules[name], edits[0]) for name, edits in tiny.edits.items())


def test_scale_rules(tmp_path):
    plain = read_adapter(write_tiny_adapter(tmp_path / "p.safetensors", "plain").path, TINY_CONFIG)
    assert {c.scale for c in plain.modules.values()} == {1.0} and "alpha = rank" in plain.notes[0]
    peft = read_adapter(write_tiny_adapter(tmp_path / "peft", "peft", rank=4, alpha=12).path, TINY_CONFIG)
    assert {c.scale for c in peft.modules.values()} == {3.0}
    rs = read_adapter(write_tiny_adapter(tmp_path / "rs", "peft-rslora", rank=4, alpha=12).path, TINY_CONFIG)
    assert {c.scale for c in rs.modules.values()} == {12 / math.sqrt(4)} and any("rsLoRA" in n for n in rs.notes)
    ar = read_adapter(write_tiny_adapter(tmp_path / "ar", "alpha-rank", rank=4, alpha=4).path, TINY_CONFIG)
    assert {c.scale for c in ar.modules.values()} == {1.0}


def test_peft_rank_and_alpha_patterns(tmp_path):
    tiny = write_tiny_adapter(tmp_path / "peft", "peft", rank=4, alpha=8)
    config = json.loads((tiny.path / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"down_proj": 2}
    (tiny.path / "adapter_config.json").write_text(json.dumps(config))
    adapter = read_adapter(tiny.path, TINY_CONFIG)
    assert adapter.modules["model.layers.0.mlp.down_proj"].scale == 0.5
    assert adapter.modules["model.layers.0.mlp.up_proj"].scale == 2.0
    config["rank_pattern"] = {"q_proj": 8}
    (tiny.path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"lora_A.weight: rank 4, but .*adapter_config.json declares rank 8 \(mixed ranks\)"):
        read_adapter(tiny.path, TINY_CONFIG)


def test_a_metadata_alpha_counts(tmp_path):
    tensors = {"layers.0.self_attn.q_proj.lora_A": torch.ones(4, 128), "layers.0.self_attn.q_proj.lora_B": torch.ones(128, 4)}
    save_file(tensors, str(tmp_path / "a.safetensors"), metadata={"ss_network_alpha": "2", "ss_network_dim": "4"})
    assert read_adapter(tmp_path / "a.safetensors", TINY_CONFIG).modules["model.layers.0.self_attn.q_proj"].scale == 0.5


def test_a_directory_per_half_reads_as_one_adapter(tmp_path):
    ar = write_tiny_adapter(tmp_path / "repo" / "adapter-ar-179", "alpha-rank", half="ar", seed=1)
    nar = write_tiny_adapter(tmp_path / "repo" / "adapter-nar-179", "alpha-rank", half="nar", seed=2)
    (tmp_path / "repo" / "README.md").write_text("---\nlicense: cc-by-nc-4.0\ntags: [yue2]\n---\n# a card\n")
    adapter = read_adapter(tmp_path / "repo", TINY_CONFIG)
    assert set(adapter.modules) == set(ar.edits) | set(nar.edits)
    assert adapter.card == {"licence": "cc-by-nc-4.0"} and adapter.layout == "alpha-rank"
    write_tiny_adapter(tmp_path / "repo" / "adapter-nar-179-v2", "alpha-rank", half="nar", seed=3)
    with pytest.raises(AdapterError, match="adapter-nar-179.* both adapt the NAR half; name the directory to use"):
        read_adapter(tmp_path / "repo", TINY_CONFIG)


def test_lora_json_carries_trigger_words(tmp_path):
    adapter = read_adapter(write_tiny_adapter(tmp_path / "sv_tiny", "lora.json").path, TINY_CONFIG)
    assert adapter.card["triggers"] == ["tinystyle"] and adapter.layout == "lora.json"


def test_where_the_files_are(tmp_path):
    write_tiny_adapter(tmp_path / "two" / "a.safetensors", "plain")
    write_tiny_adapter(tmp_path / "two" / "b.safetensors", "plain")
    with pytest.raises(AdapterError, match=r"holds 2 adapter files \(a.safetensors, b.safetensors\); name the one"):
        locate(tmp_path / "two")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(AdapterError, match="only pickled weights"):
        locate(tmp_path / "pickled")
    with pytest.raises(AdapterError, match="no such file"):
        locate(tmp_path / "missing")
    (tmp_path / "x.bin").write_bytes(b"x")
    with pytest.raises(AdapterError, match="not a .safetensors file"):
        locate(tmp_path / "x.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter files"):
        locate(tmp_path / "empty")


def test_a_card_without_front_matter_says_nothing(tmp_path):
    (tmp_path / "README.md").write_text("# license: mit\n")
    assert read_card(tmp_path) == {}


def test_layout_names():
    assert layout_name({"peft"}, set(), []) == "plain"
    assert layout_name({"kohya"}, {"ar"}, []) == "comfyui"
    assert layout_name({"slider"}, set(), []) == "slider-distill"
