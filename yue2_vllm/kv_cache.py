"""The engine's KV cache form (`--kv-cache-dtype`): the forms vLLM takes, their element size, and where each runs.

`auto` keeps K/V in the model dtype (bf16; float32 for a float32 engine). The FP8 forms store one byte an
element: `fp8` (vLLM's alias of `fp8_e4m3` on CUDA and the CPU), `fp8_e4m3` and `fp8_e5m2`. Our checkpoints
carry no K/V scales, so vLLM quantizes with scale 1.0 (e4m3 holds ±448, e5m2 ±57344).

Where a form runs is read from vLLM's own checks, identical in 0.32.0 and 0.33.0 for these forms
(docs/kv-cache.md names the files): on CUDA each attention backend lists the KV dtypes it takes and vLLM picks
the first of its priority list that takes the form (FlashAttention takes FP8 only as FA3 on sm90 or FA4 on
sm100, never e5m2; FlashInfer, sm80–sm121, takes all three; Triton takes all three on any GPU); on the CPU the
attention backend takes all three on x86 with AVX-512 or AMX and a head size divisible by 32. Nothing here
imports vLLM or reads a device: callers pass what they know, `cpu_fp8_isa` reads the CPU.
"""
from __future__ import annotations

DEFAULT_FORM = "auto"
FP8_FORMS = ("fp8", "fp8_e4m3", "fp8_e5m2")
FORMS = (DEFAULT_FORM, *FP8_FORMS)
CHECKED_RELEASES = ((0, 32), (0, 33))  # the vLLM releases whose KV checks were read (major, minor)
MIN_CUDA_CAPABILITY = (8, 0)  # FlashInfer's floor; bf16 itself needs sm80
FLAG = "--kv-cache-dtype"

# vLLM's CUDA attention backends for a decoder like ours, in its priority order per GPU family (platforms/
# cuda.py), and the KV forms each takes there (fa_utils.flash_attn_supports_kv_cache_dtype and each backend's
# supported_kv_cache_dtypes). Only FlashAttention and Triton run vLLM's batch-invariant mode (--reproducible).
CUDA_PRIORITY = {10: ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN"), "other": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")}
BATCH_INVARIANT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")


def check_form(form: str, flag: str = FLAG) -> str:
    """`form` when vLLM knows it, else ValueError naming the flag and the forms."""
    if form not in FORMS:
        raise ValueError(f"{flag} {form!r}: unknown KV cache form; one of {', '.join(FORMS)}")
    return form


def is_fp8(form: str) -> bool:
    return form in FP8_FORMS


def element_bytes(form: str, model_dtype: str = "bfloat16") -> int:
    """Bytes one K or V element takes in the engine's cache: 1 for an FP8 form, else the model dtype's."""
    check_form(form)
    return 1 if is_fp8(form) else 4 if model_dtype == "float32" else 2


def cuda_takes(backend: str, form: str, capability: tuple[int, int]) -> bool:
    """Whether vLLM's CUDA attention `backend` takes `form` on a GPU of `capability` (0.32 / 0.33 checks)."""
    if not is_fp8(form):
        return True
    if backend == "FLASH_ATTN":  # FA3 on Hopper, FA4 on sm100; no e5m2 on either
        return form != "fp8_e5m2" and capability[0] in (9, 10)
    if backend == "FLASHINFER":
        return (8, 0) <= tuple(capability) <= (12, 1)
    return backend == "TRITON_ATTN"


def cuda_backend(form: str, capability: tuple[int, int], batch_invariant: bool = False) -> str | None:
    """The attention backend vLLM picks for `form` on this GPU (FlashInfer counted as installed), or None."""
    order = CUDA_PRIORITY.get(capability[0], CUDA_PRIORITY["other"])
    for backend in order:
        if batch_invariant and backend not in BATCH_INVARIANT_BACKENDS:
            continue
        if cuda_takes(backend, form, capability):
            return backend
    return None


def cpu_fp8_isa() -> bool:
    """Whether this CPU has what vLLM-CPU's FP8 KV kernels need (AVX-512 or AMX; torch's own probes, the ones
    vLLM reads)."""
    import torch

    probes = (getattr(torch.cpu, "_is_avx512_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def release(version: str | None) -> tuple[int, int] | None:
    try:
        return tuple(int(part) for part in (version or "").split("+")[0].split(".")[:2])
    except ValueError:
        return None


def kv_cache_problem(form: str, *, device_type: str, vllm_version: str | None, backend: str = "vllm",
                     cfg_engine: str = "vllm", capability: tuple[int, int] | None = None, cpu_fp8: bool | None = None,
                     head_dim: int | None = None, flag: str = FLAG) -> str | None:
    """Why `form` cannot run here, in one line naming the flag, the device and what works; None when it can.

    `backend` / `cfg_engine` are the AR backend and CFG engine asked for (`torch` keeps K/V in the model dtype: an
    FP8 form conflicts with it);
    `capability` the CUDA GPU's; `cpu_fp8` whether the CPU has AVX-512 or AMX (None: read it)."""
    check_form(form, flag)
    if not is_fp8(form):
        return None
    if backend == "torch" or cfg_engine == "torch":
        what = "the torch backend" if backend == "torch" else "the CFG engine torch (CFG songs on the torch backend)"
        return (f"{flag} {form} sets the vLLM engine's KV cache, and {what} keeps its K/V in the model dtype: use "
                f"the vllm or auto backend with CFG on the engine, or {flag} auto")
    found = release(vllm_version)
    if found not in CHECKED_RELEASES:
        return (f"{flag} {form}: vLLM {vllm_version or '(not installed)'} is not a release whose FP8 KV checks were "
                f"read (0.32, 0.33); use {flag} auto there")
    if device_type.startswith("cuda"):
        if capability is None or tuple(capability) < MIN_CUDA_CAPABILITY:
            where = f"sm{capability[0]}{capability[1]}" if capability else "this GPU"
            return (f"{flag} {form}: {where} is below sm80, where vLLM's FP8 KV backends (FlashInfer, FlashAttention "
                    f"3/4) do not run here; use {flag} auto")
        return None
    if head_dim is not None and head_dim % 32:
        return (f"{flag} {form}: vLLM-CPU's FP8 KV kernels need a head size divisible by 32, the model's is "
                f"{head_dim}; use {flag} auto")
    if not (cpu_fp8_isa() if cpu_fp8 is None else cpu_fp8):
        return (f"{flag} {form}: vLLM-CPU stores FP8 K/V only on x86 with AVX-512 or AMX, and this CPU has "
                f"neither; use {flag} auto (an FP8 KV cache runs on CUDA sm80+ and on AVX-512/AMX CPUs)")
    return None


def check_kv_cache(form: str, **where) -> str:
    """`form` when it can run where described (see `kv_cache_problem`), else ValueError with the one line."""
    problem = kv_cache_problem(form, **where)
    if problem:
        raise ValueError(problem)
    return form


def explicit(form: str) -> dict:
    """`{"kv_cache_dtype": form}` for a form other than auto, else `{}`: what the engine's `EngineArgs` get (auto
    is vLLM's default) and what a song's effective config, so its run identity, holds (the identities of songs
    made before the flag existed stay the same)."""
    return {"kv_cache_dtype": form} if is_fp8(check_form(form)) else {}
