"""The staged song pipeline: plan (ABC score) → semantic tokens → latents (NAR) → audio (VAE).

`YuE2Pipeline(model_dir, vae_dir)` loads the MoT and tokenizer once (the VAE on first decode). Each stage is a
method taking the previous stage's result; `__call__` runs all four, and `generate_to`
runs them into a directory with a checkpoint after every stage so that a crashed or cancelled
run resumes from the last stage whose files still verify.

The pipeline is the single-song orchestrator: it composes the parts in song/ (the loaded models, the engine's
life, memory admission, the stages and the run directory) and owns the song's configuration and identities.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from dataclasses import replace
from typing import Sequence

import numpy as np

from .checkpoint import default_hash_cache
from .devices import (check_dtype_support, cuda_free_bytes, device_problem, empty_cache, engine_cuda_env,  # noqa: F401
                      resolve_device, set_upstream_numerics)
from .hub import DEFAULT_MODEL, DEFAULT_VAE, HubOptions, ModelSource, resolve_model
from .model.sampling import ARBackend, ARContinuation, TorchARBackend
from .model.torch_quant import apply_memory_cap, module_bytes
from .model.modeling import YuE2Config
from .model.vae import load_vae
from .options import (AdapterOptions, AROptions, DeviceOptions, EngineOptions, LoadOptions, PipelineOptions,
                      pipeline_options)
from .protocol import GenerationConfig, Sampling, SongRequest, SongRules, default_cfg_scale
from .song.adapters import AdapterRequest, ServedAdapters
from .song.admission import device_room
from .kv_cache import explicit as explicit_kv
from .song.engine_life import CLOSE_TIMEOUT_S, EngineInputs, EngineLife, check_split, engine_settings
from .song.models import (DTYPES, SLOW_LOAD_ENV, VAE_HALO_FRAMES, LoadedModels, vae_on_device,  # noqa: F401
                          vae_placement)
from .song.progress import Progress, token_budgets
from .song.resolved import ResolvedOptions, ar_adapters, default_vae_core_frames, resolve_options  # noqa: F401
from .song.results import (BATCH_NOTE, SAMPLE_RATE, Cancelled, Decoder, OnProgress, OnStage, OnToken,  # noqa: F401
                           SemanticResult, SongResult, SymbolicPlan, Synthesizer, batch_record, check_semantic)
from .song.run_dir import (AUDIO_CONFIG_KEYS, FAILED_STATES, STAGE_RECORDS, SongRun, latent_identity,  # noqa: F401
                            peak_memory_bytes, run_identity)
from .song.continuation import ContinueRefused, ParentSong, read_parent  # noqa: F401
from .song.stages import SongStages


def _part(unit: str, name: str, doc: str) -> property:
    """A read-only attribute of one of the pipeline's parts, under the name callers know it by."""
    path = unit.split(".")
    return property(lambda self: getattr(functools.reduce(getattr, path, self), name), doc=doc)


def song_request(style=None, lyrics=None, tags=None, request: SongRequest | None = None, fields=None) -> SongRequest:
    """The song a stage is asked for: our SongRequest (the first argument, or `request=`), or upstream's keywords
    (`style` or its alias `tags`, `lyrics`, and SongRequest's other fields: `cot`, `seed`, `abc`, `cfg_scale`,
    `id`, ...)."""
    fields = dict(fields or {})
    if isinstance(style, SongRequest):
        request, style = style, None
    if request is not None:
        if not isinstance(request, SongRequest):
            raise TypeError(f"request must be a SongRequest, got {type(request).__name__}")
        beside = [name for name, value in (("style", style), ("lyrics", lyrics), ("tags", tags)) if value is not None]
        if beside or fields:
            raise TypeError(f"{(beside or list(fields))[0]} given beside a SongRequest, which holds the whole song; "
                            "give one of them")
        return request
    if style is not None and tags is not None and style != tags:
        raise ValueError("style and tags are aliases and cannot disagree")
    style = tags if style is None else style
    if lyrics is None and fields.get("instrumental") is True:
        lyrics = ""  # lyrics are optional for an instrumental
    if style is None or lyrics is None:
        raise ValueError("Provide style and lyrics (or a SongRequest)")
    return SongRequest(style=style, lyrics=lyrics, **fields)


class YuE2Pipeline:
    def __init__(self, model_dir: str | os.PathLike | ModelSource, vae_dir: str | os.PathLike | ModelSource | None,
                 *, device: str | DeviceOptions | None = None, memory_budget_gib: float | None = None,
                 backend: str | None = None, generation_config: GenerationConfig | dict | None = None,
                 verify_hashes: bool | None = None, vae_core_frames: int | None = None,
                 quantization: str | None = None, offload_ar: bool | None = None, progress: bool = False,
                 load: LoadOptions | None = None, ar: AROptions | None = None, engine: EngineOptions | None = None,
                 adapters: AdapterOptions | None = None, options: PipelineOptions | ResolvedOptions | None = None,
                 revision: str | None = None, vae_revision: str | None = None, **keywords):
        """`model_dir` / `vae_dir`: directories, repo ids (at `revision` / `vae_revision`, else their main
        revision; `from_pretrained` takes the Hub's other keywords) or resolved `hub.ModelSource`s; `vae_dir=None`
        for a pipeline that never decodes.

        The options: the typed groups (`generation_config`, `load`, `ar`, `engine`, `device`, `adapters`;
        options.py), or all of them at once as `options` (a PipelineOptions, or a ResolvedOptions resolved on this
        machine already: song/resolved.py), or flat keywords mapped onto the groups (options.FLAT_KEYWORDS):
        upstream's (`device` a name such as "cpu", `memory_budget_gib`, `backend` "torch" / "torch-eager" / "vllm"
        / "auto", `verify_hashes`, `vae_core_frames`, `quantization`, `offload_ar`), vLLM's `LLM`'s
        (`kv_cache_dtype`, `max_num_seqs`, ...) and this project's earlier ones (docs/usage.md). A keyword given
        flat and in its group too, or unknown, is a TypeError naming it. `progress`: upstream's English progress
        on stderr, a bar per stage of every song this pipeline runs (song/progress.py). What this machine cannot
        run is refused before anything loads."""
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be True or False, got {progress!r}")
        flat = {name: value for name, value in (
            ("memory_budget_gib", memory_budget_gib), ("backend", backend), ("verify_hashes", verify_hashes),
            ("vae_core_frames", vae_core_frames), ("quantization", quantization), ("offload_ar", offload_ar))
            if value is not None}
        if options is None:
            options = pipeline_options(generation_config, load=load, ar=ar, engine=engine, device=device,
                                       adapters=adapters, **flat, **keywords)
        else:
            beside = [name for name, value in (("device", device), ("generation_config", generation_config),
                                               ("load", load), ("ar", ar), ("engine", engine), ("adapters", adapters))
                      if value is not None] + list(flat) + list(keywords)
            if beside:
                raise TypeError(f"YuE2Pipeline() got {beside[0]!r} beside options=, which holds every option; give "
                                "one of them")
            if not isinstance(options, (PipelineOptions, ResolvedOptions)):
                raise TypeError(f"options must be a PipelineOptions or a ResolvedOptions, got "
                                f"{type(options).__name__}")
            if isinstance(options, ResolvedOptions) and options.device is None:
                raise ValueError(f"options: resolved for another machine's {options.device_type} (a Ray head's "
                                 "view); resolve them on this one (song.resolved.resolve_options)")
        # Refused (ValueError naming the option) before anything loads: the device, the torch execution, the dtype,
        # the KV form, the budget.
        resolved = options if isinstance(options, ResolvedOptions) else resolve_options(options)
        self.device, self.unified, self.progress = resolved.device, resolved.unified, progress
        self.numerics = set_upstream_numerics()  # process-wide, as upstream sets them at construction
        load, ar = resolved.options.load, resolved.options.ar
        start = time.perf_counter()
        # A local directory, or a Hugging Face repo id resolved to its cached snapshot (hub.py).
        sources = {"mot": resolve_model(model_dir, revision=revision, what="model"),
                   "vae": resolve_model(vae_dir, revision=vae_revision, what="vae") if vae_dir is not None else None}
        self.models = LoadedModels(sources, hashes=load.hash_cache if load.hash_cache is not None
                                   else default_hash_cache(), verify_hashes=load.verify_hashes,
                                   unified=self.unified is not None)
        # Adapters are read, checked and converted before anything else loads (docs/adapters.md); the LoRA the
        # engine runs for them is sized with the other options.
        registered = ServedAdapters.register(resolved.options.adapters, YuE2Config.load(self.model_dir))
        self.resolved = resolved.with_adapters(*ar_adapters(registered.registry), self.model_dir, self.vae_config)
        self.options = self.resolved.options  # the defaults filled in: what the engine, the stages and records read
        self.adapters = replace(registered, lora=self.resolved.lora)
        self.rules = SongRules(self.options.generation, self.tokenizer, ar.reproducible, self.adapters.listing())
        self.ar_on_device = self.resolved.ar_on_device
        self.engine_life = EngineLife(EngineInputs(self.model_dir, self.vae_config, self.resolved),
                                      self.models.hashes)
        if self.device.type == "cuda" and self.resolved.beside_engine:  # refused before anything loads
            check_split(self.engine_life.inputs)
        self._load(self.options.engine.start and ar.backend != "torch")
        self.load_timing = {"identity_seconds": self.models.identity_seconds,
                            "load_seconds": time.perf_counter() - start}

    def _load(self, start_engine: bool) -> None:
        """Load the MoT and build the stages on it. The engine worker imports vLLM and starts while this process
        loads the MoT; on unified memory it starts after the load instead (vLLM's start-up check then sees the
        MoT already in the pool). No engine outlives a pipeline that failed to start."""
        if start_engine and self.unified is None:
            self.engine_life.start_in_background()
        ar, budget_gib = self.options.ar, self.options.device.budget_gib
        try:
            self.models.load_mot(self.device, ar, self.ar_on_device)
            self.memory_cap_bytes = apply_memory_cap(self.device, budget_gib, module_bytes(self.model))
        except BaseException:
            self.close()
            raise
        if start_engine and self.unified is not None:
            self.engine_life.start_in_background()
        self.vae_placement: dict | None = None  # the last accelerator decode's placement decision
        self.torch_backend = TorchARBackend(self.model, ar.torch_execution)
        # One torch AR song at a time (the "torch lane"); with load-time proxies the NAR must not run
        # while they are swapped in, so the same lock then also covers synthesis.
        self.torch_lock = threading.RLock()
        self.stages = SongStages(
            self.model, self.tokenizer, self.rules, self.options, self.torch_backend, self.torch_lock,
            self.proxy_mode, self.ar_on_device, self.adapters, select_backend=self.select_ar_backend,
            room=lambda: self.room,
            release_engine=self.engine_life.release_for_nar, vae_on_device=self._vae_on_device,
            beside_engine=self.resolved.beside_engine)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = DEFAULT_MODEL, *, vae: str | os.PathLike | None = DEFAULT_VAE,
                        revision: str | None = None, vae_revision: str | None = None, token: str | bool | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                        progress: bool = True, **kwargs) -> "YuE2Pipeline":
        """Upstream's entry point: `m-a-p/YuE2-3B` with `m-a-p/YuE2-Vae` unless told otherwise (a repo id or a
        directory each; `vae=None` for a pipeline that never decodes). `revision` / `vae_revision`, `token`,
        `cache_dir` and `local_files_only` are huggingface_hub's (the token goes to it alone: no record, message
        or log of ours holds it); `progress` shows its download bars and, as upstream, each song's progress on
        stderr (the constructor's `progress`); `progress=False` hides both. The other keywords are the
        constructor's."""
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be True or False, got {progress!r}")
        hub = HubOptions(token=token, cache_dir=cache_dir, local_files_only=local_files_only, progress=progress)
        start = time.perf_counter()
        model_source = resolve_model(model, revision=revision, what="model", hub=hub)
        vae_source = resolve_model(vae, revision=vae_revision, what="vae", hub=hub) if vae is not None else None
        resolve_seconds = time.perf_counter() - start
        pipe = cls(model_source, vae_source, progress=progress, **kwargs)
        pipe.load_timing["resolve_seconds"] = resolve_seconds
        return pipe

    # -- the parts, under the names callers use

    sources = _part("models", "sources", "where the weights were read from (hub.ModelSource per model)")
    model_dir = _part("models", "model_dir", "the MoT's directory")
    vae_dir = _part("models", "vae_dir", "the VAE's directory (None: this pipeline never decodes)")
    weights = _part("models", "weights", "the weights' identities (sha256s)")
    hashes = _part("models", "hashes", "the hash cache the weights' identities come from")
    verify_hashes = _part("models", "verify_hashes", "whether cached hashes are re-verified")
    vae_config = _part("models", "vae_config", "the VAE's checked config (None without a VAE)")
    tokenizer = _part("models", "tokenizer", "the MoT's tokenizer")
    model = _part("models", "model", "the loaded MoT")
    vae = _part("models", "vae", "the fp32 VAE decoder, loaded on first use")
    quantization_status = _part("models", "quantization_status", "what the load did with --quantization")
    proxy_mode = _part("models", "proxy_mode", "the load-time proxies' mode (they serve the torch AR phases)")
    start_retry = _part("engine_life", "start_retry", "a failed engine start, and when it is tried again")
    generation_config = _part("options", "generation", "the generation config songs run with")
    backend_requested = _part("options.ar", "backend", "the AR backend asked for (torch, vllm or auto)")
    room = _part("engine_life", "room", "where songs' buffers are admitted (a discrete GPU beside the engine; "
                                        "None: nothing to admit into)")

    # -- the engine's life (song/engine_life.py)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the vLLM engine worker, if one runs (the torch models stay loaded), and any start of it in
        progress first (`stop_starting`)."""
        self.engine_life.close(timeout)

    def stop_starting(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop any start of the engine in progress (see EngineLife.stop_starting); a running engine runs on."""
        self.engine_life.stop_starting(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def engine_settings(self, checkpoint) -> "EngineSettings":
        """The engine this pipeline starts: its options, sized against what the torch side keeps."""
        return engine_settings(self.engine_life.inputs, checkpoint)

    @property
    def engine(self):
        """The vLLM backend when this pipeline serves the AR half on vLLM (None on the torch backend)."""
        return None if self.backend_requested == "torch" else self.engine_life.vllm_backend()[0]

    def select_ar_backend(self, cfg_scale: float, legacy_off: bool) -> tuple[ARBackend, str | None]:
        """`(backend, fallback_reason)`: vLLM whenever it can serve, else torch with the reason why not."""
        if self.backend_requested == "torch":
            return self.torch_backend, None
        vllm, reason = self.engine_life.select(cfg_scale, legacy_off, self.options.ar.cfg_engine)
        return (vllm, None) if vllm is not None else (self.torch_backend, reason)

    # -- memory admission and placement (song/admission.py, song/models.py)

    def nar_need(self, semantics: Sequence[SemanticResult]) -> int:
        """Device bytes a NAR run of these songs takes beyond the resident weights (admission.nar_need)."""
        return self.stages.nar_need(semantics)

    def _device_room(self) -> int | None:
        return device_room(self.device, self.room, self.unified)

    @contextlib.contextmanager
    def _vae_on_device(self, vae=None, core_frames: int | None = None):
        """`vae` (fp32; None: the pipeline's) on the pipeline's device for one decode in tiles of `core_frames`
        (None: the pipeline's `vae_core_frames`; on the CPU nothing moves). Only a discrete GPU without the engine
        moves the AR expert out for it (models.vae_placement): beside the engine the tile was admitted into the room
        and the AR expert is in host memory already; on unified memory a move to the host frees nothing (one
        pool)."""
        vae = vae if vae is not None else self.vae
        if self.device.type == "cpu":
            yield vae
            return
        movable = self.room is None and self.unified is None
        core_frames = core_frames or self.options.device.vae_core_frames
        self.vae_placement = vae_placement(vae, self.model, self.device, core_frames, self._device_room(), movable)
        with vae_on_device(vae, self.model, self.device, self.vae_placement["ar_moved"]):
            yield vae

    # -- configuration and identities

    def sampling_for(self, request_overrides: dict | Sampling | None, phase: str) -> Sampling:
        return self.rules.sampling_for(request_overrides, phase)

    def effective_config(self, request: SongRequest, abc_sampling=None, semantic_sampling=None, *,
                         adapters: AdapterRequest | None = None) -> dict:
        """What the song's identity holds besides the request and the weights; `adapters` what `check_request`
        resolved for the song (None: resolved here)."""
        adapters = adapters if adapters is not None else self.adapters.resolve(request, engine=False)
        generation = replace(self.generation_config, abc=self.rules.phase_sampling(request, abc_sampling, "abc"),
                             semantic=self.rules.phase_sampling(request, semantic_sampling, "semantic"))
        defaults = GenerationConfig().to_dict()
        overrides = sorted(f"{phase}.{key}" for phase in ("abc", "semantic")
                           for key, value in generation.to_dict()[phase].items() if defaults[phase][key] != value)
        overrides += sorted(key for key in ("ode_steps", "context") if getattr(generation, key) != defaults[key])
        if request.guidance != default_cfg_scale(request.cot):
            overrides.append("cfg_scale")
        load, ar, device = self.options.load, self.options.ar, self.options.device
        return {
            "generation": generation.to_dict(), "overrides": overrides, "cot": request.cot,
            "cfg_scale": request.guidance,
            "cfg_negative": "instruction_only" if request.cot == "off" else "same_instruction_and_exact_abc",
            "backend": ar.backend, "cfg_engine": ar.cfg_engine, "quantization": ar.quantization,
            "quantization_status": self.quantization_status,
            "ar_checkpoint": None if ar.backend == "torch" else (load.ar_checkpoint and str(load.ar_checkpoint))
            or "derived", "model_dtype": "bfloat16",
            "vae_dtype": "float32", "vae_decode": "halo_crop", "vae_core_frames": device.vae_core_frames,
            "vae_halo_frames": VAE_HALO_FRAMES, "device": str(self.device),
            "memory_budget_gib": device.budget_gib, "offload_ar": device.offload_ar, "dtype": ar.dtype,
            "decoder_release": self.vae_config.release_variant if self.vae_config else None,
            **({"reproducible": True} if ar.reproducible else {}),  # absent: identities of earlier runs hold
            **explicit_kv(self.options.engine.kv_cache_dtype),  # auto: absent, so identities of earlier runs hold
            # the adapters' contents and scales (an instrumental adapter's recipe too); absent without any, so
            # identities of earlier runs hold
            **adapters.config(),
        }

    def check_request(self, request: SongRequest, abc_sampling=None, semantic_sampling=None) -> AdapterRequest:
        """Refuse, before anything runs, what `SongRules.check_request` refuses (an unknown adapter among it) and,
        where the AR half may run on vLLM (`resolved.beside_engine`), a stack of AR adapters above the engine's
        rank. Returns the song's adapters, resolved once: pass them on
        (`effective_config`, `plan`, `generate_to`) so that no stage resolves them again."""
        self.rules.check_request(request, abc_sampling, semantic_sampling)
        return self.adapters.resolve(request, engine=self.resolved.beside_engine)

    def source_records(self) -> dict:
        """Where the weights were read from, recorded beside the identity (LoadedModels.source_records)."""
        return self.models.source_records()

    def run_identity(self, request: SongRequest, config: dict) -> str:
        """The song's identity: request, effective config and all weights (upstream's request identity)."""
        return run_identity(request, config, self.weights)

    def latent_identity(self, request: SongRequest, config: dict) -> str:
        """What the plan, semantic and latent stages depend on: the song's identity without the VAE."""
        return latent_identity(request, config, self.weights)

    # -- stages (song/stages.py)

    @contextlib.contextmanager
    def _shown(self, on_token: OnToken | None, on_progress: OnProgress | None, budgets: dict | None = None,
               done: dict | None = None):
        """`(on_token, on_progress)` for one stage: the caller's, and with `progress` also its bar on stderr."""
        if not self.progress:
            yield on_token, on_progress
            return
        bars = Progress(True, budgets or {}, done)

        def token(phase: str, token_id: int) -> None:
            bars.on_token(phase, token_id)
            if on_token is not None:
                on_token(phase, token_id)

        def progress(stage: str, count: int, total: int) -> None:
            bars.on_progress(stage, count, total)
            if on_progress is not None:
                on_progress(stage, count, total)

        try:
            yield token, progress
        finally:
            bars.close()

    def plan(self, style: str | SongRequest | None = None, lyrics: str | None = None, *, tags: str | None = None,
             request: SongRequest | None = None, abc_sampling=None, cancelled: Cancelled | None = None,
             on_token: OnToken | None = None, adapters: AdapterRequest | None = None, **fields) -> SymbolicPlan:
        """The song's score: `plan(request)` (a SongRequest), or upstream's `plan(style, lyrics, cot=..., seed=...,
        abc=..., id=...)` / `plan(request=...)`. `adapters`: what `check_request` returned (None: resolved
        here), carried on the plan."""
        request = song_request(style, lyrics, tags, request, fields)
        budgets = token_budgets(self.rules, request, {"abc": abc_sampling}) if self.progress else None
        with self._shown(on_token, None, budgets) as (on_token, _):
            return self.stages.plan(request, abc_sampling=abc_sampling, cancelled=cancelled, on_token=on_token,
                                    adapters=adapters)

    def generate_semantic(self, plan: SymbolicPlan, *, sampling=None, cancelled: Cancelled | None = None,
                          on_token: OnToken | None = None,
                          continuation: ARContinuation | None = None) -> SemanticResult:
        """The song's codec tokens; `continuation`: go on from a capped song's (see `continue_song`)."""
        budgets = token_budgets(self.rules, plan.request, {"semantic": sampling}) if self.progress else None
        done = {"semantic": len(continuation.tokens)} if continuation is not None else None
        with self._shown(on_token, None, budgets, done) as (on_token, _):
            return self.stages.generate_semantic(plan, sampling=sampling, cancelled=cancelled, on_token=on_token,
                                                 continuation=continuation)

    def synthesize(self, semantic: SemanticResult, *, cancelled: Cancelled | None = None,
                   on_progress: OnProgress | None = None) -> np.ndarray:
        """One song's latents `[T, 64]`: upstream's one-song path, bit for bit."""
        with self._shown(None, on_progress) as (_, on_progress):
            return self.stages.synthesize(semantic, cancelled=cancelled, on_progress=on_progress)

    def synthesize_many(self, semantics: Sequence[SemanticResult], *, cancelled: Sequence[Cancelled | None] = (),
                        on_progress: Sequence[OnProgress | None] = ()) -> list[np.ndarray | BaseException]:
        """Several songs' latents in one batched flow matching (within bf16 rounding of `synthesize`);
        per song its latents or the exception that ended it."""
        return self.stages.synthesize_many(semantics, cancelled=cancelled, on_progress=on_progress)

    def decode(self, latents: np.ndarray, *, full: bool = False, vae: str | os.PathLike | None = None,
               cancelled: Cancelled | None = None, on_progress: OnProgress | None = None) -> np.ndarray:
        """`[T, 64]` (or `[1, 64, T]`) latents → `[1920·T − 64, 2]` float32 audio clamped to [-1, 1]. Upstream's
        keywords: `full` decodes in one pass instead of tiles; `vae` decodes with another VAE (a directory or a
        Hub repo id, loaded for this call; e.g. the legacy decoder for cached latents) instead of the pipeline's."""
        decoder = self.vae if vae is None else load_vae(resolve_model(vae, what="vae").path, device="cpu")
        with self._shown(None, on_progress) as (_, on_progress):
            return self.stages.decode(decoder, latents, full=full, cancelled=cancelled, on_progress=on_progress)

    def __call__(self, style: str | SongRequest | None = None, lyrics: str | None = None, *,
                 tags: str | None = None, request: SongRequest | None = None, abc_sampling=None,
                 semantic_sampling=None, cancelled: Cancelled | None = None, on_token: OnToken | None = None,
                 on_progress: OnProgress | None = None, **fields) -> SongResult:
        """One whole song: `pipe(request)` (a SongRequest), or upstream's `pipe(style=..., lyrics=..., cot=...,
        seed=..., abc=..., cfg_scale=..., id=...)`, `pipe(**request_json)`."""
        request = song_request(style, lyrics, tags, request, fields)
        adapters = self.check_request(request, abc_sampling, semantic_sampling)
        config = self.effective_config(request, abc_sampling, semantic_sampling, adapters=adapters)
        start = time.perf_counter()
        plan = self.plan(request, abc_sampling=abc_sampling, cancelled=cancelled, on_token=on_token,
                         adapters=adapters)
        semantic = self.generate_semantic(plan, sampling=semantic_sampling, cancelled=cancelled, on_token=on_token)
        nar_start = time.perf_counter()
        latents = self.synthesize(semantic, cancelled=cancelled, on_progress=on_progress)
        vae_start = time.perf_counter()
        if cancelled is not None and cancelled():  # as upstream: a song cancelled during the NAR is not decoded
            raise InterruptedError("cancelled before the VAE")
        audio = self.decode(latents, cancelled=cancelled, on_progress=on_progress)
        end = time.perf_counter()
        timing = {"abc": plan.timing, "semantic": semantic.timing, "nar_seconds": vae_start - nar_start,
                  "vae_seconds": end - vae_start, "load": self.load_timing, "e2e_seconds": end - start}
        return SongResult(semantic, latents, audio, SAMPLE_RATE, config, self.weights, timing,
                          self.run_identity(request, config))

    # -- resumable runs (song/run_dir.py)

    def generate_to(self, directory: str | os.PathLike, request: SongRequest, *, resume: bool = False,
                    abc_sampling=None, semantic_sampling=None, stage: str = "audio",
                    cancelled: Cancelled | None = None, on_token: OnToken | None = None,
                    on_progress: OnProgress | None = None, on_stage: OnStage | None = None,
                    synthesizer: Synthesizer | None = None, decoder: Decoder | None = None,
                    parent: ParentSong | None = None, adapters: AdapterRequest | None = None) -> dict:
        """Run into `directory`, checkpointing each stage; returns the `result.json` document
        (or, with `stage="plan"`, the plan record). Resuming redoes only stages that do not verify. `adapters`:
        what `check_request` returned for this request when the caller admitted it (None: admitted here).

        `on_stage(stage, event, meta)` reports each stage as it starts (`"start"`), is reused from a
        verified checkpoint (`"reused"`) or finishes (`"done"`, with the stage's record). A song
        scheduler passes `synthesizer` / `decoder` to run those stages in its shared synthesis lane
        (defaults: `self.synthesize` / `self.decode`). `parent` continues that capped song (`continue_song`)."""
        return SongRun(self, directory, request, resume=resume, abc_sampling=abc_sampling,
                       semantic_sampling=semantic_sampling, stage=stage, cancelled=cancelled, on_token=on_token,
                       on_progress=on_progress, on_stage=on_stage, synthesizer=synthesizer, decoder=decoder,
                       parent=parent, adapters=adapters).run()

    def continue_song(self, parent_dir: str | os.PathLike, directory: str | os.PathLike, seconds: float, *,
                      song_id: str | None = None, resume: bool = False, cancelled: Cancelled | None = None,
                      on_token: OnToken | None = None, on_progress: OnProgress | None = None,
                      on_stage: OnStage | None = None) -> dict:
        """Continue the capped song in `parent_dir` to `seconds` into `directory` (a new song, `<parent id>.
        <seconds>s` unless `song_id`): the song the parent's request with this `seconds` makes, its semantic
        phase going on from the parent's codes (song/continuation.py). Returns its result.json; a song that is
        unfinished, not capped, from another model or made with other adapters is refused (ContinueRefused, one
        line)."""
        parent = read_parent(parent_dir)
        request = parent.child_request(seconds, song_id)
        overrides = parent.overrides()
        return self.generate_to(directory, request, resume=resume, abc_sampling=overrides["abc"],
                                semantic_sampling=overrides["semantic"], cancelled=cancelled, on_token=on_token,
                                on_progress=on_progress, on_stage=on_stage, parent=parent)
