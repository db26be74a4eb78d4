"""vLLM's attention backend choice for our decoder, per faked device × KV form × --reproducible, against the
selection facts read from vLLM 0.32 / 0.33 (docs/kv-cache.md cites each by file and line)."""
import pytest

from yue2_vllm.attention import (CUBIN_HOWTO, Packages, Setup, card_name, choose, fa_version, flashinfer_kernels,
                                 installed_packages, serves)
from yue2_vllm.kv_cache import FORMS, engine_setup, kv_cache_problem

GPUS = ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1))
# (sm, --reproducible) -> per form (auto, fp8, fp8_e4m3, fp8_e5m2): "BACKEND[/variant]" vLLM picks, "!" when the
# engine would not start with it, "~" when it starts but the cache holds another form (Triton keeps e5m2 as
# e4m3), "-" when no backend is valid. The CUDA wheel's packages (FA3, FA4, FlashInfer), no flashinfer-cubin.
# Below sm80 --reproducible is a float32 engine, not vLLM's batch-invariant mode.
EXPECTED = {
    (75, False): ("-", "-", "-", "-"),  # vLLM refuses a bf16 engine below sm80
    (75, True): ("TRITON_ATTN", "TRITON_ATTN!", "TRITON_ATTN!", "TRITON_ATTN!"),
    (80, False): ("FLASH_ATTN/FA2", "FLASHINFER", "FLASHINFER", "FLASHINFER"),
    (80, True): ("FLASH_ATTN/FA2", "TRITON_ATTN!", "TRITON_ATTN!", "TRITON_ATTN!"),
    (86, False): ("FLASH_ATTN/FA2", "FLASHINFER", "FLASHINFER", "FLASHINFER"),
    (86, True): ("FLASH_ATTN/FA2", "TRITON_ATTN!", "TRITON_ATTN!", "TRITON_ATTN!"),
    (89, False): ("FLASH_ATTN/FA2", "FLASHINFER", "FLASHINFER", "FLASHINFER"),
    (89, True): ("FLASH_ATTN/FA2", "TRITON_ATTN", "TRITON_ATTN", "TRITON_ATTN~"),
    (90, False): ("FLASH_ATTN/FA3", "FLASH_ATTN/FA3", "FLASH_ATTN/FA3", "FLASHINFER"),
    (90, True): ("FLASH_ATTN/FA3", "FLASH_ATTN/FA3", "FLASH_ATTN/FA3", "TRITON_ATTN~"),
    (100, False): ("FLASHINFER", "FLASHINFER", "FLASHINFER", "FLASHINFER"),
    (100, True): ("FLASH_ATTN/FA2", "TRITON_ATTN", "TRITON_ATTN", "TRITON_ATTN~"),  # batch invariance: FA4 -> FA2
    (120, False): ("FLASH_ATTN/FA2", "FLASHINFER", "FLASHINFER", "FLASHINFER"),
    (120, True): ("FLASH_ATTN/FA2", "TRITON_ATTN", "TRITON_ATTN", "TRITON_ATTN~"),
    (121, False): ("FLASH_ATTN/FA2", "FLASHINFER", "FLASHINFER", "FLASHINFER"),
    (121, True): ("FLASH_ATTN/FA2", "TRITON_ATTN", "TRITON_ATTN", "TRITON_ATTN~"),
}


def sm(capability) -> int:
    return capability[0] * 10 + capability[1]


def label(choice, form: str, dtype: str) -> str:
    if choice.backend is None:
        return "-"
    name = choice.backend + (f"/{choice.variant}" if choice.variant else "")
    if not choice.starts:
        return name + "!"
    expected = dtype if form == "auto" else "fp8_e5m2" if form == "fp8_e5m2" else "fp8_e4m3"
    return name + ("~" if choice.stored_as != expected else "")


@pytest.mark.parametrize("release", ["0.28.0", "0.32.0", "0.33.0"])
@pytest.mark.parametrize("reproducible", [False, True])
@pytest.mark.parametrize("capability", GPUS, ids=[f"sm{sm(c)}" for c in GPUS])
def test_each_faked_gpu_gets_the_backend_vllm_picks_and_every_failing_form_is_refused(capability, reproducible,
                                                                                      release):
    got = []
    for form in FORMS:
        setup = engine_setup(form, device_type="cuda", vllm_version=release, capability=capability,
                             reproducible=reproducible)
        got.append(label(choose(setup), form, setup.dtype))
        problem = kv_cache_problem(form, device_type="cuda", vllm_version=release, capability=capability,
                                   reproducible=reproducible)
        if form == "auto":
            assert problem is None  # auto is never the KV check's to refuse (bf16 below sm80: devices.py)
            continue
        serves_it = not got[-1].endswith(("!", "~")) and got[-1] != "-"
        assert (problem is None) == serves_it, (form, got[-1], problem)
        if problem:  # one line naming the flag, the card and what works instead
            assert "\n" not in problem and problem.startswith(f"--kv-cache-dtype {form}")
            assert card_name(capability) in problem and problem.endswith("--kv-cache-dtype auto")
            assert (" with --reproducible on " in problem) == reproducible
    assert tuple(got) == EXPECTED[sm(capability), reproducible]


def test_the_refusals_say_why_and_what_works():
    a10 = kv_cache_problem("fp8", device_type="cuda", vllm_version="0.32.0", capability=(8, 6), reproducible=True,
                           device_name="NVIDIA A10")
    assert a10 == ("--kv-cache-dtype fp8 with --reproducible on NVIDIA A10 (sm86): Triton attention is the first that "
                   "takes it, and its FP8 K/V needs sm89+ (it raises at engine start); what works: --kv-cache-dtype "
                   "fp8 without --reproducible, or --kv-cache-dtype auto")
    h100 = kv_cache_problem("fp8_e5m2", device_type="cuda", vllm_version="0.33.0", capability=(9, 0),
                            reproducible=True)
    assert "vLLM picks TRITON_ATTN, which stores every FP8 form as e4m3: fp8_e5m2 would silently be fp8_e4m3" in h100
    assert h100.endswith("what works: --kv-cache-dtype fp8, or --kv-cache-dtype fp8_e5m2 without --reproducible, or "
                         "--kv-cache-dtype auto")
    # Without FlashInfer an sm86 falls to Triton for every FP8 form, which fails there; an sm89 keeps e4m3 only.
    bare = Packages(flashinfer=False)
    a40 = kv_cache_problem("fp8", device_type="cuda", vllm_version="0.32.0", capability=(8, 6), packages=bare)
    assert "FP8 K/V needs sm89+" in a40 and "flashinfer-python installed" in a40
    assert kv_cache_problem("fp8", device_type="cuda", vllm_version="0.32.0", capability=(8, 9), packages=bare) is None
    assert "keeps" not in kv_cache_problem("fp8_e5m2", device_type="cuda", vllm_version="0.32.0", capability=(8, 9),
                                           packages=bare)
    # The CPU: vLLM-CPU's ISA and head-size rules.
    cpu = kv_cache_problem("fp8", device_type="cpu", vllm_version="0.33.0", cpu_fp8=False)
    assert cpu.startswith("--kv-cache-dtype fp8 on this CPU: vLLM-CPU stores FP8 K/V only on x86 with AVX-512 or AMX")
    assert "head size divisible by 32 (the model's is 48)" in kv_cache_problem(
        "fp8", device_type="cpu", vllm_version="0.32.0", cpu_fp8=True, head_dim=48)


def test_packages_runner_and_release_facts():
    hopper = Setup("cuda", "fp8", (0, 32), (9, 0))
    # A source build without FA3 runs FA2 on Hopper, which takes no FP8: FlashInfer then serves it.
    assert choose(hopper).variant == "FA3" and fa_version(Setup("cuda", capability=(9, 0),
                                                                packages=Packages(fa3=False))) == 2
    no_fa3 = choose(Setup("cuda", "fp8", (0, 32), (9, 0), packages=Packages(fa3=False)))
    assert no_fa3.backend == "FLASHINFER" and dict(no_fa3.passed_over)["FLASH_ATTN"].startswith("FP8 KV cache requires")
    # FlashInfer's decode kernel: XQA (sm90, sm12x), trtllm-gen (sm10x) only with their cubins.
    for capability, special in (((9, 0), "xqa"), ((12, 1), "xqa"), ((10, 0), "trtllm-gen"), ((8, 9), "native")):
        setup = Setup("cuda", "fp8_e5m2", (0, 32), capability)
        assert choose(setup).decode_kernel in ("native", None)
        cubins = Setup("cuda", "fp8_e5m2", (0, 32), capability, packages=Packages(flashinfer_cubin=True))
        assert choose(cubins).decode_kernel == special
        assert choose(Setup("cuda", "fp8_e5m2", (0, 32), capability, packages=Packages(online=True))).decode_kernel \
            == special
    # Both model runners build the same attention layers; 0.32 and 0.33 choose alike; other releases are not known.
    for capability in GPUS:
        for form in FORMS:
            for invariant in (False, True):
                base = Setup("cuda", form, (0, 32), capability, batch_invariant=invariant)
                assert choose(base) == choose(Setup("cuda", form, (0, 33), capability, batch_invariant=invariant,
                                                    runner="v2"))
    new = choose(Setup("cuda", "fp8", (0, 34), (9, 0)))
    assert not new.read and not new.starts and choose(Setup("cuda", "auto", (0, 34), (9, 0))).starts
    assert choose(Setup("cuda", "fp8", (0, 28), (9, 0))) == choose(hopper)  # 0.28-0.31: the same rules
    assert serves(Setup("cpu", "fp8_e5m2", (0, 33))) and not serves(Setup("cpu", "fp8", (0, 32), cpu_fp8=False))
    assert choose(Setup("cpu", "fp8_e5m2", (0, 32), dtype="float32")).stored_as == "fp8_e5m2"


def test_flashinfer_kernels_report_names_the_cubins_and_the_offline_way(tmp_path):
    offline = flashinfer_kernels((9, 0), Packages())
    assert offline["decode_kernel"] == "native" and offline["decode_kernel_online"] == "xqa"
    assert offline["note"] == CUBIN_HOWTO.format(kernel="xqa") and "vllm download-kernels" in offline["note"]
    assert "pip install --no-index" in offline["note"]
    cubins = flashinfer_kernels((10, 0), Packages(flashinfer_cubin=True))
    assert cubins == {"installed": True, "flashinfer_cubin": True, "decode_kernel": "trtllm-gen"}
    ada = flashinfer_kernels((8, 9), Packages())
    assert ada["decode_kernel"] == "native" and "native kernels on this GPU" in ada["note"]
    # What is installed, from the files a CUDA wheel ships (FA3's extension, FA4's CuTe sources), not imported.
    wheel = tmp_path / "vllm"
    (wheel / "vllm_flash_attn" / "cute").mkdir(parents=True)
    assert installed_packages(environ={}, vllm_dir=wheel) == Packages(flashinfer=False, fa3=False, fa4=False)
    (wheel / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").write_bytes(b"")
    (wheel / "vllm_flash_attn" / "cute" / "interface.py").write_text("")
    found = installed_packages(environ={"VLLM_HAS_FLASHINFER_CUBIN": "1"}, vllm_dir=wheel)
    assert (found.fa3, found.fa4, found.flashinfer_cubin, found.flashinfer) == (True, True, True, False)
