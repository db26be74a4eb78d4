import hashlib
import subprocess
import sys

from yue2_vllm.checkpoint import weight_index
from yue2_vllm.model.modeling import tensor_shapes
from yue2_vllm.testing import TINY_CONFIG, tiny_default, write_tiny_model


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_deterministic(tiny_model_dir, tmp_path):
    again = write_tiny_model(tmp_path / "again")
    for name in ("config.json", "model.safetensors", "qwen.tiktoken"):
        assert digest(again / name) == digest(tiny_model_dir / name)
    other = write_tiny_model(tmp_path / "other", seed=1)
    assert digest(other / "model.safetensors") != digest(tiny_model_dir / "model.safetensors")


def test_tiny_model_has_real_vocab_and_bf16(tiny_model_dir):
    infos = weight_index(tiny_model_dir)
    assert {n: i.shape for n, i in infos.items()} == tensor_shapes(TINY_CONFIG)
    assert infos["lm_head.weight"].shape == (184704, 128)
    assert {i.dtype for i in infos.values()} == {"BF16"}


def test_tiny_default_is_generated_once(tmp_path):
    model_dir, vae_dir = tiny_default(tmp_path)
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_default(tmp_path) == (model_dir, vae_dir)
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert (vae_dir / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["YuE2-3B-tiny", "YuE2-Vae-tiny"]


def test_import_pulls_no_heavy_optional_packages():
    code = ("import sys, yue2_vllm, yue2_vllm.cli, yue2_vllm.model.modeling, yue2_vllm.model.vae, yue2_vllm.testing, "
            "yue2_vllm.tokenizer, yue2_vllm.checkpoint, yue2_vllm.protocol\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'triton', 'llmcompressor'}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_write_random_model_streams_the_tiny_models_tensors(tmp_path):
    """Any size, one tensor at a time (bench --model release-size writes YuE2-3B's this way): at the tiny size it
    holds exactly the tiny checkpoint's tensors."""
    import torch
    from safetensors.torch import load_file

    from yue2_vllm.testing import tiny_state_dict, write_random_model

    written = load_file(str(write_random_model(tmp_path / "m") / "model.safetensors"))
    expected = tiny_state_dict()
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)
