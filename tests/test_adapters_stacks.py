"""Several AR adapters on one song as one vLLM adapter: ranks concatenated, B @ A the sum of the deltas."""
import json

import torch
from safetensors.torch import load_file

from yue2_vllm.adapters.cache import convert_adapter
from yue2_vllm.adapters.stacks import STACK_RECORD, ar_directory, stack_rank
from yue2_vllm.peft_format import CONFIG as PEFT_CONFIG
from yue2_vllm.peft_format import WEIGHTS as PEFT_WEIGHTS
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.testing_adapters import write_tiny_adapter


def test_a_stack_is_the_sum_of_its_adapters(tmp_path):
    cache = tmp_path / "cache"
    one = write_tiny_adapter(tmp_path / "one.safetensors", "plain", rank=4, seed=1)
    two = write_tiny_adapter(tmp_path / "two", "peft", rank=8, seed=2, half="both")
    nar = write_tiny_adapter(tmp_path / "nar", "peft", half="nar")
    uses = [(convert_adapter(one.path, TINY_CONFIG, cache_dir=cache), 0.5),
            (convert_adapter(two.path, TINY_CONFIG, cache_dir=cache), 2.0),
            (convert_adapter(nar.path, TINY_CONFIG, cache_dir=cache), 1.0)]
    directory = ar_directory(uses, cache)
    assert directory.parent.name == "stacks" and ar_directory(uses, cache) == directory
    assert stack_rank(uses[:2]) == 12
    config = json.loads((directory / PEFT_CONFIG).read_text())
    assert config["r"] == config["lora_alpha"] == 12
    tensors = load_file(str(directory / PEFT_WEIGHTS))
    truth = {**one.scaled(0.5)}
    for module, edits in two.scaled(2.0).items():
        truth.setdefault(module, [])
        truth[module] = truth[module] + edits
    for module, edits in truth.items():
        if ".nar_" in module:
            continue
        a = tensors[f"base_model.model.{module}.lora_A.weight"]
        b = tensors[f"base_model.model.{module}.lora_B.weight"]
        torch.testing.assert_close(b @ a, sum(e.scale * e.b @ e.a for e in edits), rtol=1e-6, atol=1e-6)
    assert json.loads((directory / STACK_RECORD).read_text())["rank"] == 12


def test_one_adapter_is_its_own_directory_and_none_is_none(tmp_path):
    cache = tmp_path / "cache"
    one = convert_adapter(write_tiny_adapter(tmp_path / "a.safetensors", "plain").path, TINY_CONFIG, cache_dir=cache)
    nar = convert_adapter(write_tiny_adapter(tmp_path / "n", "peft", half="nar").path, TINY_CONFIG, cache_dir=cache)
    assert ar_directory([(one, 1.0), (nar, 0.5)], cache) == one.ar_path
    assert ar_directory([(one, 0.5)], cache) == one.ar_directory(0.5)
    assert ar_directory([(nar, 1.0)], cache) is None and ar_directory([(one, 0.0)], cache) is None
