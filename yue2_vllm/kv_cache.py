"""The engine's KV cache form (`--kv-cache-dtype`): the forms vLLM takes, their element size, and the one-line
refusal of a form that would not run as asked.

`auto` keeps K/V in the model dtype (bf16; float32 for a float32 engine). The FP8 forms store one byte an
element: `fp8` (vLLM's alias of `fp8_e4m3` on CUDA and the CPU), `fp8_e4m3` and `fp8_e5m2`. Our derived
checkpoints carry no K/V scales, so vLLM quantizes with scale 1.0 (e4m3 holds ±448, e5m2 ±57344); a
compressed-tensors checkpoint that declares a `kv_cache_scheme` brings its own.

Where a form runs is `attention.choose` (vLLM's own selection order and checks, per device, release and
switch); a form is refused before anything loads when the engine would not start with it, or would store
something else (Triton keeps `fp8_e5m2` as e4m3), naming the card and what works instead. Under `auto`, a
checkpoint whose `kv_cache_scheme` would switch vLLM to FP8 K/V by itself is refused too: the flag, the plan
and the record then always say what the engine runs (pass `fp8` to run such a checkpoint, with its scales).
Nothing here imports vLLM or reads a device: callers pass what they know, `cpu_fp8_isa` reads the CPU.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .attention import READ_RELEASES, Packages, Setup, card_name, choose, serves, stored_form
from .vllm_release import release

DEFAULT_FORM = "auto"
FP8_FORMS = ("fp8", "fp8_e4m3", "fp8_e5m2")
FORMS = (DEFAULT_FORM, *FP8_FORMS)
CHECKED_RELEASES = READ_RELEASES  # the vLLM releases whose KV checks were read (major, minor)
FLAG = "--kv-cache-dtype"


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


def cpu_fp8_isa() -> bool:
    """Whether this CPU has what vLLM-CPU's FP8 KV kernels need (AVX-512 or AMX; torch's own probes, the ones
    vLLM reads)."""
    import torch

    probes = (getattr(torch.cpu, "_is_avx512_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def checkpoint_kv_scheme(path) -> dict | None:
    """The `kv_cache_scheme` an AR checkpoint's config.json declares (compressed-tensors), None when it declares
    none or has no config (nothing but the JSON is read)."""
    config = Path(path) / "config.json" if path else None
    if config is None or not config.is_file():
        return None
    try:
        quantization = json.loads(config.read_text(encoding="utf-8")).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return None
    scheme = quantization.get("kv_cache_scheme") if isinstance(quantization, dict) else None
    return scheme or None


def engine_setup(form: str, *, device_type: str, vllm_version: str | None, capability: tuple[int, int] | None = None,
                 reproducible: bool = False, dtype: str = "bfloat16", runner: str = "v1",
                 packages: Packages | None = None, cpu_fp8: bool | None = None, head_dim: int | None = None) -> Setup:
    """The `attention.Setup` our engine starts with: `--reproducible` is vLLM's batch-invariant mode on CUDA sm80+
    and a float32 engine elsewhere (engine.runner.batch_invariance)."""
    cuda = device_type.startswith("cuda")
    invariant = reproducible and cuda and capability is not None and tuple(capability) >= (8, 0)
    if reproducible and not invariant:
        dtype = "float32"
    return Setup("cuda" if cuda else "cpu", form, release(vllm_version), tuple(capability) if capability else None,
                 dtype, invariant, runner, packages or Packages(),
                 (cpu_fp8_isa() if cpu_fp8 is None else cpu_fp8) if not cuda and is_fp8(form) else True,
                 head_dim or 128)


def _what_works(setup: Setup, flag: str, reproducible: bool) -> str:
    """The nearest settings that serve: another FP8 form, the same without --reproducible, with FlashInfer
    installed, and always the default form."""
    options, seen = [], {stored_form(setup.form)}
    for form in FP8_FORMS:
        if stored_form(form) not in seen and serves(replace(setup, form=form)):
            seen.add(stored_form(form))
            options.append(f"{flag} {form}")
    if reproducible and setup.device == "cuda" and serves(replace(setup, batch_invariant=False)):
        options.append(f"{flag} {setup.form} without --reproducible")
    if setup.device == "cuda" and not setup.packages.flashinfer and serves(
            replace(setup, packages=replace(setup.packages, flashinfer=True))):
        options.append("flashinfer-python installed (vLLM's CUDA wheel depends on it)")
    options.append(f"{flag} auto")
    return "what works: " + ", or ".join(options)


def option_problem(form: str, *, backend: str = "vllm", cfg_engine: str = "vllm", checkpoint=None,
                   flag: str = FLAG) -> str | None:
    """What refuses `form` whatever the device: an unknown form (ValueError), the torch backend or CFG engine
    (they keep K/V in the model dtype), and an AR checkpoint whose `kv_cache_scheme` would switch vLLM to FP8 K/V
    under auto (or that vLLM refuses fp8_e5m2 with)."""
    check_form(form, flag)
    if is_fp8(form) and (backend == "torch" or cfg_engine == "torch"):
        what = "the torch backend" if backend == "torch" else "the CFG engine torch (CFG songs on the torch backend)"
        return (f"{flag} {form} sets the vLLM engine's KV cache, and {what} keeps its K/V in the model dtype: use "
                f"the vllm or auto backend with CFG on the engine, or {flag} auto")
    scheme = checkpoint_kv_scheme(checkpoint) if backend != "torch" else None
    if scheme is not None and form == DEFAULT_FORM:
        return (f"{flag} auto: the AR checkpoint {checkpoint} declares a kv_cache_scheme, which makes vLLM store K/V "
                f"in FP8 with the checkpoint's scales although auto was asked; pass {flag} fp8 to run it so (recorded "
                f"with its scales), or serve a checkpoint without a kv_cache_scheme")
    if scheme is not None and form == "fp8_e5m2":
        return (f"{flag} fp8_e5m2: the AR checkpoint {checkpoint} declares a kv_cache_scheme (e4m3 scales) and vLLM "
                f"refuses fp8_e5m2 with it at engine start; what works: {flag} fp8")
    return None


def kv_cache_problem(form: str, *, device_type: str, vllm_version: str | None, backend: str = "vllm",
                     cfg_engine: str = "vllm", capability: tuple[int, int] | None = None, cpu_fp8: bool | None = None,
                     head_dim: int | None = None, flag: str = FLAG, reproducible: bool = False,
                     dtype: str = "bfloat16", runner: str = "v1", packages: Packages | None = None,
                     device_name: str | None = None, checkpoint=None) -> str | None:
    """Why `form` cannot run as asked here, in one line naming the flag, the card and what works; None when it can.

    `backend` / `cfg_engine` are the AR backend and CFG engine asked for (`torch` keeps K/V in the model dtype: an
    FP8 form conflicts with it); `capability` / `device_name` the CUDA GPU's; `cpu_fp8` whether the CPU has
    AVX-512 or AMX (None: read it); `reproducible`, `dtype`, `runner` and `packages` the engine's switches and the
    attention packages installed (attention.Packages: the CUDA wheel's by default); `checkpoint` an AR checkpoint
    directory the engine will serve (its `kv_cache_scheme` is read)."""
    problem = option_problem(form, backend=backend, cfg_engine=cfg_engine, checkpoint=checkpoint, flag=flag)
    if problem or not is_fp8(form):
        return problem
    if release(vllm_version) not in CHECKED_RELEASES:
        return (f"{flag} {form}: vLLM {vllm_version or '(not installed)'} is not a release whose FP8 KV checks were "
                f"read (0.28-0.33); use {flag} auto there")
    setup = engine_setup(form, device_type=device_type, vllm_version=vllm_version, capability=capability,
                         reproducible=reproducible, dtype=dtype, runner=runner, packages=packages, cpu_fp8=cpu_fp8,
                         head_dim=head_dim)
    choice = choose(setup)
    if serves(setup, choice):
        return None
    reason = choice.problem or (f"vLLM picks {choice.backend}, which stores every FP8 form as e4m3: {form} would "
                                f"silently be {choice.stored_as}")
    where = card_name(setup.capability, device_name) if setup.device == "cuda" else "this CPU"
    switches = " with --reproducible" if reproducible else ""
    return f"{flag} {form}{switches} on {where}: {reason}; {_what_works(setup, flag, reproducible)}"


def check_kv_cache(form: str, **where) -> str:
    """`form` when it can run where described (see `kv_cache_problem`), else ValueError with the one line."""
    problem = kv_cache_problem(form, **where)
    if problem:
        raise ValueError(problem)
    return form


def record_problem(record: dict, form: str, dtype: str = "bfloat16") -> str | None:
    """Why the engine's own record (engine.worker.kv_cache_record) does not match the form asked for: a KV dtype
    switched by the checkpoint, a cache that holds another form, or a record that could not be read; None when
    it matches."""
    if "error" in record:
        return f"the engine's KV cache could not be read back ({record['error']})"
    ran, held = record.get("kv_cache_dtype"), record.get("stored_as")
    if ran != form:
        return (f"vLLM runs its KV cache as {ran} where {form} was asked (an AR checkpoint's kv_cache_scheme switches "
                f"it to fp8); pass {FLAG} {ran}" if isinstance(ran, str) else f"vLLM runs its KV cache as {ran}")
    if held != stored_form(form, dtype):
        return f"vLLM's {record.get('attention_backend')} stores {form} as {held}"
    return None


def explicit(form: str) -> dict:
    """`{"kv_cache_dtype": form}` for a form other than auto, else `{}`: what the engine's `EngineArgs` get (auto
    is vLLM's default) and what a song's effective config, so its run identity, holds (the identities of songs
    made before the flag existed stay the same)."""
    return {"kv_cache_dtype": form} if is_fp8(check_form(form)) else {}


TABLE_GPUS = ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1))  # docs/kv-cache.md's rows
_DECODE = {"xqa": "XQA", "trtllm-gen": "trtllm-gen"}
_NAMES = {"FLASHINFER": "FlashInfer", "TRITON_ATTN": "Triton", "CPU_ATTN": "CPU", "FLEX_ATTENTION": "FlexAttention"}


def _cell(setup: Setup) -> str:
    """One cell of the support table: the backend vLLM picks, or why the form is refused."""
    choice = choose(setup)
    if serves(setup, choice):
        name = choice.variant or _NAMES.get(choice.backend, choice.backend)
        if choice.backend == "FLASHINFER":
            special = choose(replace(setup, packages=replace(setup.packages, flashinfer_cubin=True))).decode_kernel
            name += f" ({_DECODE[special]} decode with cubins)" if special != "native" else ""
        return name
    if choice.backend is None:
        return "— (bf16 needs sm80)" if setup.dtype == "bfloat16" else "refused"
    if not choice.starts:
        return "refused: Triton's FP8 needs sm89" if choice.backend == "TRITON_ATTN" else "refused"
    return f"refused: {_NAMES.get(choice.backend, choice.backend)} keeps it as e4m3"


def support_table_markdown(release_: tuple[int, int] = (0, 32), packages: Packages | None = None) -> str:
    """docs/kv-cache.md's table: per GPU, the attention backend vLLM picks for each form with and without
    --reproducible (FlashAttention's version; FlashInfer's special decode kernel where cubins are had), or the
    refusal. Kept in step with the page by tests/test_kv_cache.py."""
    packages = packages or Packages()
    lines = ["| GPU | auto | fp8, fp8_e4m3 | fp8_e5m2 | --reproducible: auto | fp8, fp8_e4m3 | fp8_e5m2 |",
             "|---|---|---|---|---|---|---|"]
    for capability in TABLE_GPUS:
        cells = []
        for invariant in (False, True):
            for form in ("auto", "fp8", "fp8_e5m2"):
                dtype = "float32" if invariant and capability < (8, 0) else "bfloat16"
                cells.append(_cell(Setup("cuda", form, release_, capability, dtype, invariant and capability >= (8, 0),
                                         packages=packages)))
        lines.append(f"| {card_name(capability)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
