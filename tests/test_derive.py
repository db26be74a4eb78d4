import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from yue2_vllm.checkpoint import CheckpointError, HashCache
from yue2_vllm.derive import DerivationError, derive_ar_checkpoint, qwen_config, validate_ar_checkpoint
from yue2_vllm.model.modeling import YuE2Config, ar_tensor_shapes
from yue2_vllm.quant.schemes import runnable_reason
from yue2_vllm.quant_scheme import parse_quantization
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.engine.backend import kv_cache_bytes, unsupported_reason

PUBLISHED_FP8 = Path(__file__).parent / "data" / "published-fp8-config.json"  # DKmode22/YuE2-3B-FP8


@pytest.fixture(scope="module")
def derived(tiny_model_dir, tmp_path_factory):
    return derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))


def test_derived_tensors_are_byte_identical(derived, tiny_model_dir):
    names = list(ar_tensor_shapes(TINY_CONFIG))
    assert len(names) == 3 + 11 * 2
    with safe_open(str(derived / "model.safetensors"), "pt") as out, \
            safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as src:
        assert sorted(out.keys()) == sorted(names)
        for name in names:
            a, b = out.get_tensor(name), src.get_tensor(name)
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
    config = json.loads((derived / "config.json").read_text())
    assert config == qwen_config(TINY_CONFIG) and config["architectures"] == ["Qwen3ForCausalLM"]
    record = json.loads((derived / "derivation.json").read_text())
    assert record["tensor_count"] == 25 and record["schema"] == 1 and derived.name == record["identity"]
    assert set(record["sha256"]) == {"model.safetensors", "config.json"}


def test_reuse_and_corruption(tiny_model_dir, tmp_path):
    first = derive_ar_checkpoint(tiny_model_dir, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert derive_ar_checkpoint(tiny_model_dir, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    config = json.loads((first / "config.json").read_text())
    config["hidden_size"] = 64
    (first / "config.json").write_text(json.dumps(config))
    with pytest.raises(DerivationError, match=r"Corrupt derived AR cache: .*config.json does not match.*delete .* to "
                                              r"rebuild"):
        derive_ar_checkpoint(tiny_model_dir, tmp_path)
    shutil.rmtree(first)
    assert derive_ar_checkpoint(tiny_model_dir, tmp_path) == first
    assert sorted(p.name for p in tmp_path.joinpath("yue2-ar").iterdir()) == [first.name, first.name + ".lock"]


def test_missing_ar_tensor(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"Missing AR tensors \(1\): model.layers.0.mlp.up_proj.weight"):
        derive_ar_checkpoint(bad, tmp_path / "cache")


def test_derivation_key_is_upstreams(derived, tiny_model_dir):
    # identity of {"schema": 1, "source": model_identity, "config": qwen_config}: the same cache key upstream uses
    from yue2_vllm.checkpoint import identity, model_identity

    stamp = {"schema": 1, "source": model_identity(tiny_model_dir), "config": qwen_config(TINY_CONFIG)}
    assert derived.name == identity(stamp)


def test_override_tensor_set_checked(derived, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(derived, copy)
    state = load_file(str(copy / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(128, 1, dtype=torch.bfloat16)
    del state["lm_head.weight"]
    save_file(state, str(copy / "model.safetensors"))
    with pytest.raises(DerivationError) as info:
        validate_ar_checkpoint(copy, TINY_CONFIG)
    assert "missing lm_head.weight" in str(info.value)
    assert "unexpected tensors (1): model.layers.0.self_attn.q_proj.weight_scale" in str(info.value)


def test_override_dtypes_checked(derived, tmp_path):
    """An int8 lm_head in an unquantized checkpoint has the right shape but would serve garbage."""
    copy = tmp_path / "copy"
    shutil.copytree(derived, copy)
    state = load_file(str(copy / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"].to(torch.int8)
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(state, str(copy / "model.safetensors"))
    with pytest.raises(DerivationError) as info:
        validate_ar_checkpoint(copy, TINY_CONFIG)
    assert "lm_head.weight: dtype I8, expected one of ['BF16', 'F16', 'F32', 'F64']" in str(info.value)
    assert "model.norm.weight: dtype F8_E4M3" in str(info.value)


def test_published_fp8_config_parses_and_matches_real_config():
    config = json.loads(PUBLISHED_FP8.read_text())
    scheme = parse_quantization(config)
    assert scheme.name == "W8A8-FP8" and scheme.weight_strategy == "channel" and scheme.activation_dynamic
    assert scheme.ignore == ("lm_head",) and runnable_reason(scheme, "cpu") is None
    from yue2_vllm.derive import _config_problems

    assert _config_problems(config, YuE2Config()) == []  # rope_parameters form is understood


def test_weight_only_int8_is_unservable_on_cpu():
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                          "num_bits": 8, "type": "int", "strategy": "channel"},
                                          "input_activations": None}}}}
    scheme = parse_quantization(config)
    assert scheme.name == "W8A16-INT8"
    assert "no vLLM-CPU kernel" in runnable_reason(scheme, "cpu") and runnable_reason(scheme, "cuda") is None
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        parse_quantization({"quantization_config": {"quant_method": "gptq"}})


def test_kv_cache_formula_and_version_gate():
    assert kv_cache_bytes(YuE2Config()) == 2.625 * 2**30
    assert kv_cache_bytes(YuE2Config(), max_sequences=2) == 5.25 * 2**30
    assert unsupported_reason("0.32.0") is None
    assert "outside the supported range" in unsupported_reason("0.19.0")
    assert "not installed" in unsupported_reason(None)


def test_hash_cache_skips_rehash_on_reuse(tiny_model_dir, tmp_path, monkeypatch):
    import yue2_vllm.checkpoint as ck

    cache = HashCache(tmp_path / "h.json")
    derive_ar_checkpoint(tiny_model_dir, tmp_path / "c", hashes=cache)
    calls = []
    real = ck.sha256_file
    monkeypatch.setattr(ck, "sha256_file", lambda p, *rest: calls.append(p) or real(p, *rest))
    derive_ar_checkpoint(tiny_model_dir, tmp_path / "c", hashes=cache)
    assert all(not str(p).endswith(".safetensors") for p in calls)


def test_verify_hashes_rehashes_a_cached_derivation(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A same-size corruption with its mtime put back passes the size+mtime cache, not --verify-hashes."""
    import os

    from yue2_vllm.cli import main

    monkeypatch.setenv("YUE2_VLLM_CACHE", str(tmp_path / "user-cache"))
    cache = HashCache(tmp_path / "h.json")
    target = derive_ar_checkpoint(tiny_model_dir, tmp_path / "c", hashes=cache)
    weights = target / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as handle:
        handle.seek(stat.st_size - 2)
        last = handle.read(2)
        handle.seek(stat.st_size - 2)
        handle.write(bytes(b ^ 0xFF for b in last))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert derive_ar_checkpoint(tiny_model_dir, tmp_path / "c", hashes=cache) == target  # trusted
    with pytest.raises(DerivationError, match=r"Corrupt derived AR cache: .*model.safetensors does not match"):
        derive_ar_checkpoint(tiny_model_dir, tmp_path / "c", hashes=cache, verify=True)
    assert main(["derive", str(tiny_model_dir), "--out", str(tmp_path / "c"), "--verify-hashes"]) == 2
    assert "Corrupt derived AR cache" in json.loads(capsys.readouterr().out)["reason"]


# -- stopping a derivation, and what a killed one leaves


def test_a_stopped_derivation_removes_its_temp_and_the_next_one_completes(tiny_model_dir, tmp_path):
    import threading

    from yue2_vllm.derive import derivation_bytes
    from yue2_vllm.startup import STARTUP, StepAborted, block_counter

    stop = threading.Event()
    seen = []

    def on_block(nbytes):  # 0: a block of the source hashed (the cache here is off), else one tensor's bytes copied
        if nbytes:
            seen.append(nbytes)
        if len(seen) == 3:  # mid-copy: two tensors written, the third refused
            stop.set()
        counter(nbytes)

    with STARTUP.step("deriving", "AR checkpoint", derivation_bytes(tiny_model_dir)) as step:
        counter = block_counter(step, stop)
        with pytest.raises(StepAborted, match="deriving AR checkpoint: stopped"):
            derive_ar_checkpoint(tiny_model_dir, tmp_path, on_block=on_block)
    root = tmp_path / "yue2-ar"
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []  # no temp, no target
    assert step.done_bytes == sum(seen[:2]) and 0 < step.done_bytes < step.total_bytes
    done = []
    path = derive_ar_checkpoint(tiny_model_dir, tmp_path, on_block=done.append)
    weights = path / "model.safetensors"
    assert sum(done) == derivation_bytes(tiny_model_dir)  # every AR byte copied once, the source's hashing counts 0
    assert 0 < weights.stat().st_size - sum(done) < 8192  # the rest is the safetensors header


def test_temps_of_a_killed_derivation_are_removed_but_not_a_live_ones(tiny_model_dir, tmp_path):
    import fcntl
    import threading

    first = derive_ar_checkpoint(tiny_model_dir, tmp_path)
    key, root = first.name, first.parent
    shutil.rmtree(first)
    stale = root / f".{key}.dead1234.tmp"  # what `kill -9` during a derivation leaves (atomic_directory's name)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 4096)
    other = root / ".someotherkey.x.tmp"  # another checkpoint's temp is not this derivation's to judge
    other.mkdir()
    # A live derivation holds the key's lock for as long as its temp exists: nothing is removed meanwhile.
    holder = open(root / f"{key}.lock", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    result = {}
    thread = threading.Thread(target=lambda: result.update(path=derive_ar_checkpoint(tiny_model_dir, tmp_path)))
    thread.start()
    thread.join(1.0)
    assert thread.is_alive() and stale.is_dir()  # waiting for the lock; the live temp untouched
    fcntl.flock(holder, fcntl.LOCK_UN)
    holder.close()
    thread.join(30)
    assert result["path"] == first and not stale.exists() and other.is_dir()
