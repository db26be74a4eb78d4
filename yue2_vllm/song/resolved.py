"""The pipeline's options resolved once: what each of them comes to on the machine that runs it.

As vLLM's `EngineArgs.create_engine_config` builds one `VllmConfig`, `resolve_options` builds one frozen
`ResolvedOptions` from the typed groups (options.py) and the device: the device itself, the memory it plans in (an
integrated GPU's pool shared with the host, a discrete card's bytes) and the budget (the card less a tenth, the pool,
or on the CPU 24 GiB within the machine, unless given; a budget the device cannot have is refused), the VAE tile (512
frames at a budget of 12 GiB or less, else 1024, as upstream), the typical song the engine's rows are sized for (a
prompt estimate and the larger phase budget), the AR checkpoint vLLM serves (`$YUE2_AR_CHECKPOINT` when none is
given), the KV cache form (refused where vLLM would not start it or would run another), where our AR expert lives
beside the engine, and — once the adapters are registered (`with_adapters`) — the vLLM LoRA slots and their rank.

The pipeline, the CLI, `doctor` and a Ray head read these values from it instead of working them out again; the
engine's settings are built from it (`engine_settings`). Resolved for another machine (`device` a device type: a
Ray head sizing its replicas, `doctor` showing a split), nothing is refused here: that machine refuses its own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..adapters.checks import max_lora_rank_for
from ..checkpoint import weights_bytes
from ..derive import OVERRIDE_ENV
from ..devices import check_dtype_support, resolve_device
from ..engine.lora import LoraSettings
from ..kv_cache import check_form, check_kv_cache, is_fp8, option_problem
from ..memory import (PROMPT_ESTIMATE_TOKENS, UnifiedPool, ar_expert_bytes, budget_problem, default_budget_gib,
                      device_pool, total_memory_bytes, vae_decode_bytes)
from ..model.modeling import YuE2Config
from ..model.sampling import resolve_execution
from ..model.vae import decoder_bytes
from ..options import DEFAULT_MAX_LORAS, PipelineOptions
from .models import DTYPES, VAE_HALO_FRAMES

KV_OPTION = "EngineOptions.kv_cache_dtype"  # what a KV form refusal names (the CLI names --kv-cache-dtype)


def default_vae_core_frames(memory_budget_gib: float) -> int:
    """The VAE tile when none is given: upstream's (512 frames at a budget of 12 GiB or less, else 1024)."""
    return 512 if memory_budget_gib <= 12 else 1024


def typical_tokens(generation) -> int:
    """The song the engine's rows are sized for: a prompt estimate and the larger of the two phases' budgets."""
    return PROMPT_ESTIMATE_TOKENS + max(generation.abc.max_tokens, generation.semantic.max_tokens)


def vllm_usable() -> bool:
    """Whether an installed vLLM can be driven (without importing it)."""
    from ..engine.backend import unsupported_reason, vllm_version

    return unsupported_reason(vllm_version()) is None


@dataclass(frozen=True)
class ResolvedOptions:
    """A pipeline's options with everything they imply on one machine worked out (see the module's words).
    `options` holds them with the defaults filled in (the device as resolved, the budget, the VAE tile, the AR
    checkpoint, the KV form): what records and identities read."""

    options: PipelineOptions
    device: torch.device | None  # None: resolved for another machine's `device_type` (nothing refused here)
    device_type: str  # "cpu", "cuda", "mps"
    unified: UnifiedPool | None  # an integrated GPU's pool, shared with the host
    card_bytes: int | None  # a discrete GPU's memory (None elsewhere, and where this machine has no GPU to read)
    typical_tokens: int  # the song the engine's rows are sized for
    beside_engine: bool  # the AR half is served on vLLM whenever it can (backend vllm or auto, a usable vLLM)
    ar_on_device: bool  # our AR expert stays on the device (beside the engine on a discrete GPU: host memory)
    lora: LoraSettings = LoraSettings()  # the vLLM LoRA slots the registered AR adapters need (`with_adapters`)

    @property
    def budget_gib(self) -> float:
        return self.options.device.budget_gib

    @property
    def vae_core_frames(self) -> int:
        return self.options.device.vae_core_frames

    @property
    def ar_checkpoint(self) -> str | None:
        """The AR checkpoint vLLM serves as given (or by $YUE2_AR_CHECKPOINT); None: the one derived from the MoT."""
        return self.options.load.ar_checkpoint

    @property
    def kv_cache_dtype(self) -> str:
        return self.options.engine.kv_cache_dtype

    def with_adapters(self, ar_count: int, ar_rank: int, model_dir=None, vae_config=None) -> "ResolvedOptions":
        """These options with the LoRA the engine runs for `ar_count` registered adapters with an AR part, the
        largest of rank `ar_rank`: off without any; else `AdapterOptions.max_loras` slots (None: one per adapter, at
        most DEFAULT_MAX_LORAS, fewer while the engine's memory plan for the weights in `model_dir` fails) of
        `max_lora_rank` (None: the smallest of vLLM's ranks that holds `ar_rank`)."""
        if not ar_count:
            return replace(self, lora=LoraSettings())
        adapters = self.options.adapters
        lora = LoraSettings(adapters.max_loras or min(ar_count, DEFAULT_MAX_LORAS),
                            max_lora_rank_for(adapters.max_lora_rank or ar_rank))
        sized = replace(self, lora=lora)
        if adapters.max_loras is not None or model_dir is None:
            return sized
        config = YuE2Config.load(Path(model_dir))
        inputs = EngineInputs(Path(model_dir), vae_config, sized)
        weights = estimated_engine_weights(inputs, config)
        while sized.lora.max_loras > 1 and engine_settings(inputs, None).plan(config,
                                                                              engine_weights=weights).problems():
            sized = replace(sized, lora=replace(sized.lora, max_loras=sized.lora.max_loras - 1))
            inputs = replace(inputs, resolved=sized)
        return sized


def resolve_options(options: PipelineOptions, device: torch.device | str | None = None, *,
                    kv_flag: str | None = KV_OPTION) -> ResolvedOptions:
    """`options` resolved on `device`: a torch.device this machine resolved already (the CLI's --device), None to
    resolve `options.device.device` here (ValueError naming it when this machine cannot run it), or a device type
    ("cuda", "cpu") of another machine. On this machine a torch execution or dtype the device cannot run, a budget
    it cannot have and a KV form vLLM would not start are refused (ValueError, one line naming `--budget` /
    `kv_flag`, the limit and what works); for another only what holds on any device (a KV form the backend or the AR
    checkpoint refuses). `kv_flag` None leaves the KV form unchecked (`doctor` reports what each form does
    instead)."""
    here = not isinstance(device, str)
    ar = options.ar
    if device is None:
        device = resolve_device(options.device.device)
    if here:
        resolve_execution(ar.torch_execution, device)  # e.g. graph on the CPU, refused before anything loads
        check_dtype_support(device, DTYPES[ar.dtype])
    name = str(device)
    device_type = device.type if here else name.partition(":")[0]
    unified = device_pool(name) if device_type == "cuda" else None
    card = (total_memory_bytes(name) if device_type == "cuda" and unified is None and torch.cuda.is_available()
            else None)
    given = options.device
    budget = float(given.budget_gib or default_budget_gib(unified, card))
    problem = budget_problem(budget, unified, card) if here else None
    if problem:
        raise ValueError(problem)
    load = replace(options.load, ar_checkpoint=options.load.ar_checkpoint or os.environ.get(OVERRIDE_ENV) or None)
    filled = replace(options, load=load, device=replace(
        given, device=name if here else given.device, budget_gib=budget,
        vae_core_frames=given.vae_core_frames or default_vae_core_frames(budget)))
    if kv_flag is not None:
        filled = replace(filled, engine=replace(options.engine, kv_cache_dtype=check_kv_form(
            filled, device if here else None, kv_flag)))
    # Beside the engine on a discrete GPU the torch side holds the AR expert in host memory (placement.py); the
    # load-time AR proxies serve torch-backend songs from the device, so there the AR expert stays resident.
    beside_engine = ar.backend != "torch" and vllm_usable()
    ar_on_device = not (card is not None and beside_engine and ar.quantization in ("none", "auto"))
    return ResolvedOptions(filled, device if here else None, device_type, unified, card,
                           typical_tokens(options.generation), beside_engine, ar_on_device)


def check_kv_form(options: PipelineOptions, device: torch.device | None, flag: str = KV_OPTION) -> str:
    """The engine's KV cache form (`options.engine.kv_cache_dtype`, against `options.load.ar_checkpoint` as
    resolved), refused (ValueError, one line naming `flag`, the card and what works) before anything loads where
    vLLM would not start with it on `device`, or would store another form, or where the AR checkpoint's own
    `kv_cache_scheme` would switch it (kv_cache.kv_cache_problem, attention.choose). `device` None (another
    machine's): only what holds on any device (kv_cache.option_problem)."""
    from ..attention import installed_packages
    from ..engine.backend import vllm_version

    form, ar = check_form(options.engine.kv_cache_dtype, flag), options.ar
    checkpoint = options.load.ar_checkpoint
    if device is not None and vllm_version() is None:
        checkpoint = None  # no engine here: its checkpoint is never served
    if device is None or not is_fp8(form):
        problem = option_problem(form, backend=ar.backend, cfg_engine=ar.cfg_engine, checkpoint=checkpoint,
                                 flag=flag)
        if problem:
            raise ValueError(problem)
        return form
    cuda = device.type == "cuda"
    return check_kv_cache(form, device_type=device.type, vllm_version=vllm_version(), backend=ar.backend,
                          cfg_engine=ar.cfg_engine, capability=tuple(torch.cuda.get_device_capability(device))
                          if cuda else None, device_name=torch.cuda.get_device_name(device) if cuda else None,
                          packages=installed_packages() if cuda else None, reproducible=ar.reproducible,
                          dtype=ar.dtype, checkpoint=checkpoint, flag=flag)


def ar_adapters(registry) -> tuple[int, int]:
    """`(count, largest rank)` of a registry's adapters with an AR part: what `with_adapters` sizes the LoRA by."""
    ranks = [adapter.converted.ar_rank for adapter in registry.adapters() if adapter.converted.ar_path is not None]
    return len(ranks), max(ranks, default=0)


@dataclass(frozen=True)
class EngineInputs:
    """What the engine is sized and derived from: the MoT's directory, the VAE's config (None: no VAE) and the
    resolved options (the device, the memory, where the torch side holds its AR expert, the LoRA)."""

    model_dir: Path
    vae_config: object | None
    resolved: ResolvedOptions

    @property
    def options(self) -> PipelineOptions:
        return self.resolved.options

    @property
    def device(self) -> torch.device:
        return self.resolved.device

    @property
    def unified(self) -> UnifiedPool | None:
        return self.resolved.unified

    @property
    def lora(self) -> LoraSettings:
        return self.resolved.lora


def engine_settings(inputs: EngineInputs, checkpoint) -> "EngineSettings":
    """The engine a pipeline starts: its resolved options, sized against what the torch side keeps."""
    from ..engine.backend import EngineSettings
    from ..devices import engine_cuda_env

    resolved, device = inputs.resolved, inputs.device
    options = resolved.options
    ar = options.ar
    mot_bytes = weights_bytes(inputs.model_dir) * DTYPES[ar.dtype].itemsize // 2  # stored bf16
    vae = inputs.vae_config
    vae_bytes = decoder_bytes(vae) if vae is not None else 0
    tile = vae_decode_bytes(vae, resolved.vae_core_frames, VAE_HALO_FRAMES) if vae else 0
    settings = {"typical_tokens": resolved.typical_tokens, "offload_ar": options.device.offload_ar, "dtype": ar.dtype,
                "torch_side_bytes": mot_bytes + vae_bytes, "vae_tile_bytes": tile,
                "torch_ar_on_device": resolved.ar_on_device, "kv_cache_dtype": resolved.kv_cache_dtype,
                "lora": resolved.lora, **options.engine.settings()}  # what the caller set wins over what is sized here
    settings.setdefault("cuda_visible_devices", engine_cuda_env(device).get("CUDA_VISIBLE_DEVICES"))
    if device.type == "cuda":
        settings.setdefault("cuda_capability", tuple(torch.cuda.get_device_capability(device)))
        settings.setdefault("unified", resolved.unified)
    if ar.reproducible:
        from ..engine.runner import batch_invariance

        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        settings["batch_invariance"] = invariance = batch_invariance(device.type, capability)
        if invariance.dtype is not None:
            settings["dtype"] = invariance.dtype
    return EngineSettings(checkpoint, device_type=device.type, memory_budget_gib=resolved.budget_gib, **settings)


def estimated_engine_weights(inputs: EngineInputs, config: YuE2Config) -> int:
    """The AR checkpoint's bytes before it exists: the override's files, else the bf16 AR expert a derivation holds."""
    ar_checkpoint = inputs.resolved.ar_checkpoint
    override = Path(ar_checkpoint) if ar_checkpoint else None
    return weights_bytes(override) if override is not None and override.is_dir() else ar_expert_bytes(config)
