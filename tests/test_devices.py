from types import SimpleNamespace

import pytest
import torch

from yue2_vllm import devices
from yue2_vllm.devices import (UPSTREAM_NUMERICS, bf16_problem, check_dtype_support, cuda_room, engine_cuda_env,
                               numerics_differences, numerics_flags, resolve_device, set_upstream_numerics)

GIB = 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two visible CUDA devices, the current one being 1, on a machine without CUDA."""
    state = SimpleNamespace(current=1, capability=(9, 0), name="Fake H200", fractions=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state.current)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: state.capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: state.name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: state.fractions.append((fraction, device)))
    return state


@pytest.fixture
def upstream_flags_restored():
    saved = numerics_flags()
    yield
    for flag, value in saved.items():
        if flag == "float32_matmul_precision":
            torch.set_float32_matmul_precision(value)
        else:
            target, attr = devices._flag_owner(flag)
            setattr(target, attr, value)


def test_cuda_devices_always_carry_an_index(fake_cuda):
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    fake_cuda.current = 0
    assert resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"device 'cuda:2': there are only 2 CUDA devices"):
        resolve_device("cuda:2")


def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("mps")
    assert resolve_device("mps") == torch.device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="MPS is not available"):
        resolve_device("mps")


@pytest.mark.parametrize("name,message", [("gpu", "not a device"), ("xpu", "device type 'xpu' is not supported"),
                                          ("cuda", "CUDA is not available")])
def test_bad_devices_are_named(monkeypatch, name, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=f"device {name!r}: {message}"):
        resolve_device(name)


def test_bf16_needs_compute_capability_8(fake_cuda):
    assert bf16_problem("A100", (8, 0)) is None and bf16_problem("H200", (9, 0)) is None
    assert bf16_problem("Tesla T4", (7, 5)).startswith("Tesla T4 (compute capability 7.5) has no native bfloat16")
    check_dtype_support(torch.device("cuda", 1), torch.bfloat16)
    fake_cuda.capability, fake_cuda.name = (7, 5), "Tesla T4"
    with pytest.raises(ValueError, match=r"device cuda:1: Tesla T4 \(compute capability 7.5\) has no native bf"):
        check_dtype_support(torch.device("cuda", 1), torch.bfloat16)
    check_dtype_support(torch.device("cuda", 1), torch.float32)  # float32 runs anywhere
    check_dtype_support(torch.device("cpu"), torch.bfloat16)


def test_upstream_numerics_flags_are_set(upstream_flags_restored):
    set_upstream_numerics()
    torch.backends.cudnn.allow_tf32 = True  # torch's defaults: TF32 convolutions, benchmarking
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")  # also turns TF32 matmuls on
    assert set(numerics_differences()) == {"cudnn.allow_tf32", "cudnn.benchmark", "cuda.matmul.allow_tf32",
                                           "float32_matmul_precision"}
    flags = set_upstream_numerics()
    assert flags == dict(UPSTREAM_NUMERICS) and numerics_differences() == {}
    assert torch.backends.cudnn.deterministic is True and torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is False
    assert torch.get_float32_matmul_precision() == "highest" and len(flags) == 6


def test_engine_is_pinned_to_the_pipelines_gpu(fake_cuda):
    assert engine_cuda_env("cuda:1", environ={}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert engine_cuda_env("cuda", environ={}) == {"CUDA_VISIBLE_DEVICES": "1"}  # the current device
    assert engine_cuda_env(torch.device("cuda", 0), environ={"CUDA_VISIBLE_DEVICES": ""}) == {
        "CUDA_VISIBLE_DEVICES": "0"}
    # This process's cuda:1 is the second entry of its own CUDA_VISIBLE_DEVICES.
    assert engine_cuda_env("cuda:1", environ={"CUDA_VISIBLE_DEVICES": "2, 3"}) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert engine_cuda_env("cuda:0", environ={"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}) == {
        "CUDA_VISIBLE_DEVICES": "GPU-a1"}
    with pytest.raises(ValueError, match=r"cuda:1 is not among CUDA_VISIBLE_DEVICES='5' \(1 visible\)"):
        engine_cuda_env("cuda:1", environ={"CUDA_VISIBLE_DEVICES": "5"})
    assert engine_cuda_env("cpu") == {} and engine_cuda_env("mps") == {}


def test_cuda_room_counts_the_cache_and_the_cap():
    # 2 GiB cached and reusable, plus growth bounded by the cap (8 - 6 reserved) and the device's free bytes.
    assert cuda_room(free=10 * GIB, reserved=6 * GIB, allocated=4 * GIB, cap=8 * GIB) == 4 * GIB
    assert cuda_room(free=1 * GIB, reserved=6 * GIB, allocated=4 * GIB, cap=8 * GIB) == 3 * GIB
    assert cuda_room(free=10 * GIB, reserved=6 * GIB, allocated=4 * GIB, cap=None) == 12 * GIB
    assert cuda_room(free=10 * GIB, reserved=9 * GIB, allocated=9 * GIB, cap=8 * GIB) == 0  # over the cap
    with pytest.raises(ValueError, match="inconsistent memory figures"):
        cuda_room(free=1, reserved=1, allocated=2, cap=None)


def test_cuda_free_bytes_reads_the_allocator_and_the_cap(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (30 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 20 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 15 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 0.275)  # 22 GiB of 80
    assert devices.process_cap_bytes("cuda:1") == 22 * GIB
    assert devices.cuda_free_bytes("cuda:1") == 5 * GIB + 2 * GIB  # mem_get_info alone says 30 GiB


def test_importing_devices_pulls_in_no_vllm():
    import subprocess
    import sys

    code = "import sys, yue2_vllm.devices; print([m for m in ('vllm', 'triton') if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_unified_memory_is_is_integrated_checked_by_capability(fake_gpu):
    from yue2_vllm.devices import unified_memory

    fake_gpu("GB10")
    assert unified_memory("cuda") == (True, "is_integrated=True, sm_121: GB10 (DGX Spark)")
    for name in ("B200", "H100", "L40S"):
        fake_gpu(name)
        unified, why = unified_memory("cuda:0")
        assert not unified and why.endswith("discrete memory")
    fake_gpu("GB10", integrated=False)  # the capability alone does not make it unified
    assert unified_memory(0) == (False, "sm_121 is GB10 (DGX Spark)'s capability, but torch reports "
                                        "is_integrated=False: planned as discrete")
    fake_gpu("H100", integrated=True)  # an integrated part we do not know: one pool, the safe side, said so
    unified, why = unified_memory("cuda")
    assert unified and "not a known integrated part" in why
