"""The staged song pipeline: plan (ABC score) → semantic tokens → latents (NAR) → audio (VAE).

`YuE2Pipeline(model_dir, vae_dir)` loads the MoT and tokenizer once (the VAE on first decode). Each stage is a
method taking the previous stage's result; `__call__` runs all four, and `generate_to`
runs them into a directory with a checkpoint after every stage so that a crashed or cancelled
run resumes from the last stage whose files still verify.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from . import artifacts as art
from . import instrumental
from .checkpoint import (HashCache, default_hash_cache, drop_page_cache, identity, model_identity, weights_bytes,
                         write_json_atomic)
from .model.loader import load_model
from .model.modeling import YuE2Config
from .model.nar import SongInput, offloaded_ar, synthesize_many
from .model.nar import synthesize as nar_synthesize
from .protocol import (CODEC_OFFSET, CODEC_SIZE, GenerationConfig, Sampling, SongRequest, SongRules, abc_prompt,
                       check_abc_ids, check_token_ids, default_cfg_scale, negative_prompt, semantic_prompt)
from .derive import OVERRIDE_ENV, derivation_bytes
from .startup import STARTUP, StartRetry, StepAborted, block_counter
from .hub import DEFAULT_MODEL, DEFAULT_VAE, HubOptions, resolve_model
from .devices import (check_dtype_support, cuda_free_bytes, device_problem, empty_cache, engine_cuda_env,  # noqa: F401
                      resolve_device, set_upstream_numerics)
from .memory import (PROMPT_ESTIMATE_TOKENS, ar_expert_bytes, ar_host_bytes, budget_problem, default_budget_gib,
                     device_pool, nar_song_bytes, torch_decode_bytes, total_memory_bytes, unified_pool,
                     vae_decode_bytes)
from .model.sampling import ARBackend, TorchARBackend, resolve_execution
from .model.torch_quant import apply_memory_cap, module_bytes, prepare_ar_proxies, proxy_slow_reason, restore_ar
from .tokenizer import YuE2Tokenizer
from .model.vae import check_vae, decoder_bytes, load_vae
from .model.placement import placement_of
from .room import DeviceRoom

LOG = logging.getLogger(__name__)
SAMPLE_RATE = 48000
VAE_HALO_FRAMES = 16
SLOW_LOAD_ENV = "YUE2_TEST_LOAD_DELAY_S"  # tests only: seconds added to the MoT load (a server's slow start-up)
CLOSE_TIMEOUT_S = 10.0  # close() waits this long at most for a background engine start to stop
BACKENDS = ("torch", "vllm", "auto")
CFG_ENGINES = ("vllm", "torch")  # where cfg_scale != 1 and cot=off songs run when the backend is vllm/auto
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # float32: verification runs of both AR backends
# Per stage: the files its record must list (with hashes) and the meta keys the later stages read.
STAGE_RECORDS = {"plan": (("prefix.npy", "abc_tokens.npy"), ("abc", "timing", "truncated")),
                 "semantic": (("semantic.npy",), ("timing", "truncated")),
                 "synthesis": (("latent.npy",), ("nar_seconds",)),
                 "audio": (("audio.flac",), ("vae_seconds", "samples"))}
# Effective-config keys only the audio (VAE) stage depends on.
AUDIO_CONFIG_KEYS = ("vae_dtype", "vae_decode", "vae_core_frames", "vae_halo_frames", "decoder_release")
# Run states of a failed stage, named as upstream's.
FAILED_STATES = {"plan": "plan_failed", "semantic": "semantic_failed", "synthesis": "synthesis_failed",
                 "audio": "decode_failed"}
OnToken = Callable[[str, int], None]
OnProgress = Callable[[str, int, int], None]
Cancelled = Callable[[], bool]
OnStage = Callable[[str, str, "dict | None"], None]
Synthesizer = Callable[..., np.ndarray]  # (semantic, *, cancelled, on_progress) -> latents
Decoder = Callable[..., np.ndarray]  # (latents, *, cancelled, on_progress) -> audio


@dataclass
class SymbolicPlan:
    """The score phase's outcome: ABC text and its exact ids, and the semantic prompt built from them."""

    request: SongRequest
    abc: str | None
    abc_ids: list[int]
    prefix: list[int]
    timing: dict = field(default_factory=dict)
    truncated: bool = False
    instrumental: "instrumental.InstrumentalSteps | None" = None  # an instrumental song's steps of the recipe


@dataclass
class SemanticResult:
    plan: SymbolicPlan
    tokens: list[int]  # codec indices 0..32767 (token id − CODEC_OFFSET)
    timing: dict = field(default_factory=dict)
    truncated: bool = False
    synthesis: dict = field(default_factory=dict)  # the NAR's record: prefill weights, room admitted/waited


@dataclass
class SongResult:
    semantic: SemanticResult
    latents: np.ndarray  # [T, 64] float32
    audio: np.ndarray  # [1920·T − 64, 2] float32 in [-1, 1]
    sample_rate: int
    config: dict
    weights: dict
    timing: dict
    identity: str

    @property
    def plan(self) -> SymbolicPlan:
        return self.semantic.plan

    @property
    def request(self) -> SongRequest:
        return self.plan.request

    @property
    def truncated(self) -> dict:
        return {"abc": self.plan.truncated, "semantic": self.semantic.truncated}

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / self.sample_rate


def default_vae_core_frames(memory_budget_gib: float) -> int:
    return 512 if memory_budget_gib <= 12 else 1024


def check_semantic(semantic: "SemanticResult") -> None:
    """What the NAR needs: codec indices, and a prefix of vocabulary ids."""
    if not semantic.tokens:
        raise ValueError("the semantic phase produced no tokens; there is nothing to synthesize")
    check_token_ids(semantic.tokens, "semantic.tokens", 0, CODEC_SIZE, "a codec index")
    check_token_ids(semantic.plan.prefix, "plan.prefix")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes so far: CUDA max allocated on an accelerator, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


BATCH_NOTE = ("the AR tokens may depend on the other songs the engine served at the same time (bf16 on vLLM); "
              "--reproducible (serve: reproducible) makes a seed fix the song")


def batch_record(*timings: dict | None) -> dict:
    """result.json's word on reproducibility: whether every AR phase ran batch-invariant, else why not."""
    invariant = all((timing or {}).get("batch_invariant", False) for timing in timings if timing)
    return {"batch_invariant": invariant} if invariant else {"batch_invariant": False, "batch_note": BATCH_NOTE}


def vllm_usable() -> bool:
    """Whether an installed vLLM can be driven (without importing it)."""
    from .engine.backend import unsupported_reason, vllm_version

    return unsupported_reason(vllm_version()) is None


class YuE2Pipeline:
    def __init__(self, model_dir: str | os.PathLike, vae_dir: str | os.PathLike | None, *, device: str = "auto",
                 memory_budget_gib: float | None = None, backend: str = "torch",
                 generation_config: GenerationConfig | dict | None = None, verify_hashes: bool = False,
                 vae_core_frames: int | None = None, hash_cache: HashCache | None = None,
                 ar_checkpoint: str | os.PathLike | None = None, keep_engine: bool | None = None,
                 engine_options: dict | None = None, quantization: str = "none", offload_ar: bool = False,
                 dtype: str = "bfloat16", start_engine: bool = False, cfg_engine: str = "vllm",
                 quantized_policy: str = "auto", revision: str | None = None, vae_revision: str | None = None,
                 reproducible: bool = False, torch_execution: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if memory_budget_gib is not None and not memory_budget_gib > 0:
            raise ValueError(f"memory_budget_gib must be positive, got {memory_budget_gib!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        if cfg_engine not in CFG_ENGINES:
            raise ValueError(f"cfg_engine must be one of {CFG_ENGINES}, got {cfg_engine!r}")
        self.cfg_engine, self.quantized_policy = cfg_engine, quantized_policy
        self.reproducible = bool(reproducible)  # the engine is batch-invariant: a seed fixes the song under load
        # A local directory, or a Hugging Face repo id resolved to its cached snapshot (hub.py).
        self.sources = {"mot": resolve_model(model_dir, revision=revision, what="model"),
                        "vae": resolve_model(vae_dir, revision=vae_revision, what="vae") if vae_dir is not None
                        else None}
        self.model_dir = self.sources["mot"].path
        self.vae_dir = self.sources["vae"].path if self.sources["vae"] is not None else None
        self.device = resolve_device(device)
        resolve_execution(torch_execution, self.device)  # refuse e.g. graph on the CPU before loading anything
        check_dtype_support(self.device, DTYPES[dtype])
        self.numerics = set_upstream_numerics()  # process-wide, as upstream sets them at construction
        # An integrated GPU (DGX Spark) shares the host's memory: one pool, MemAvailable less an OS reserve.
        self.unified = device_pool(str(self.device)) if self.device.type == "cuda" else None
        # A discrete GPU: the card is the default budget (less memory.DEVICE_RESERVE_FRACTION) and the cap.
        card = total_memory_bytes(str(self.device)) if self.device.type == "cuda" and self.unified is None else None
        self.memory_budget_gib = float(memory_budget_gib or default_budget_gib(self.unified, card))
        problem = budget_problem(self.memory_budget_gib, self.unified, card)
        if problem:
            raise ValueError(problem)
        self.backend_requested = backend
        if isinstance(generation_config, GenerationConfig):
            self.generation_config = generation_config
        else:
            self.generation_config = GenerationConfig.from_dict(generation_config)
        self.vae_core_frames = vae_core_frames or default_vae_core_frames(self.memory_budget_gib)
        start = time.perf_counter()
        self.hashes = hash_cache if hash_cache is not None else default_hash_cache()
        self.verify_hashes = verify_hashes
        self.weights = {"mot": self._hashed(self.model_dir, "model"),
                        "vae": self._hashed(self.vae_dir, "vae") if self.vae_dir is not None else None}
        # Checked now (config, names, shapes, float32), not after the AR and NAR stages have run.
        self.vae_config = check_vae(self.vae_dir) if self.vae_dir is not None else None
        identity_seconds = time.perf_counter() - start
        self.tokenizer = YuE2Tokenizer.from_model_dir(self.model_dir)
        self.rules = SongRules(self.generation_config, self.tokenizer, self.reproducible)
        self.quantization = quantization
        self.dtype, self.offload_ar = dtype, bool(offload_ar)
        self.ar_checkpoint = ar_checkpoint or os.environ.get(OVERRIDE_ENV) or None
        self.keep_engine, self.engine_options = keep_engine, dict(engine_options or {})
        self._vllm = None
        self._vllm_unavailable: str | None = None
        self._vllm_lock = threading.Lock()
        self._prestart: threading.Thread | None = None
        self._prestart_error: BaseException | None = None
        self._closing = threading.Event()  # close() in progress: start-up steps (derive, engine start) stop
        self._stops = 0  # stop_starting calls so far: a song that asked before one starts no engine after it
        self.start_retry = StartRetry()  # a failed engine start, and when it is tried again
        self._room: DeviceRoom | None = None  # songs' buffers on a discrete GPU beside the engine (room.py)
        # Beside the engine on a discrete GPU the torch side holds the AR expert in host memory (placement.py).
        # (Load-time AR proxies serve torch-backend songs from the device: there the AR expert stays resident.)
        self.ar_on_device = not (card is not None and backend != "torch" and vllm_usable()
                                 and quantization in ("none", "auto"))
        if self.device.type == "cuda" and backend != "torch" and vllm_usable():  # refused before anything loads
            self._check_split()
        if start_engine and backend != "torch" and self.unified is None:
            # The worker imports vLLM and starts its engine while this process loads the MoT. On unified memory
            # it starts after the load instead: vLLM's start-up check then sees the MoT already in the pool.
            self._start_engine_in_background()
        # Load-time proxies without a fast kernel on this device are declined on the record (see quantized_policy).
        declined = proxy_slow_reason(quantization, self.device, DTYPES[dtype]) if quantized_policy != "force" else None
        try:
            with STARTUP.step("loading", "model", weights_bytes(self.model_dir)):
                time.sleep(float(os.environ.get(SLOW_LOAD_ENV) or 0))  # tests only: a load that takes a while
                self.model = load_model(self.model_dir, device=self.device, dtype=DTYPES[dtype],
                                        quantization="none" if declined else quantization,
                                        ar_on_device=self.ar_on_device)
            self.memory_cap_bytes = apply_memory_cap(self.device, self.memory_budget_gib, module_bytes(self.model))
        except BaseException:
            self.close()  # no engine outlives a pipeline that failed to start
            raise
        if self.unified is not None:  # the MoT is in (unified) memory now; its file pages need not be too
            drop_page_cache(self.model_dir)
            if start_engine and backend != "torch":
                self._start_engine_in_background()
        if declined:
            LOG.info("load-time %s proxies declined: %s", quantization, declined)
            self.model.quantization_status = {**self.model.quantization_status, "requested": quantization,
                                              "declined": declined}
        self.quantization_status = dict(self.model.quantization_status)
        # Load-time proxies serve the torch AR phases only; the NAR always runs on the exact originals.
        self.proxy_mode = quantization if self.quantization_status.get("source") == "load_time" else None
        self._vae = None
        self.vae_placement: dict | None = None  # the last accelerator decode's placement decision
        self.load_timing = {"identity_seconds": identity_seconds, "load_seconds": time.perf_counter() - start}
        self.torch_backend = TorchARBackend(self.model, torch_execution)
        # One torch AR song at a time (the "torch lane"); with load-time proxies the NAR must not run
        # while they are swapped in, so the same lock then also covers synthesis.
        self.torch_lock = threading.RLock()

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = DEFAULT_MODEL, *, vae: str | os.PathLike | None = DEFAULT_VAE,
                        revision: str | None = None, vae_revision: str | None = None, token: str | bool | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                        progress: bool = True, **kwargs) -> "YuE2Pipeline":
        """Upstream's entry point: `m-a-p/YuE2-3B` with `m-a-p/YuE2-Vae` unless told otherwise (a repo id or a
        directory each; `vae=None` for a pipeline that never decodes). `revision` / `vae_revision`, `token`,
        `cache_dir` and `local_files_only` are huggingface_hub's (the token goes to it alone: no record, message
        or log of ours holds it); `progress=False` hides its download bars. The other keywords are the
        constructor's."""
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be True or False, got {progress!r}")
        hub = HubOptions(token=token, cache_dir=cache_dir, local_files_only=local_files_only, progress=progress)
        start = time.perf_counter()
        model_source = resolve_model(model, revision=revision, what="model", hub=hub)
        vae_source = resolve_model(vae, revision=vae_revision, what="vae", hub=hub) if vae is not None else None
        resolve_seconds = time.perf_counter() - start
        pipe = cls(model_source, vae_source, **kwargs)
        pipe.load_timing["resolve_seconds"] = resolve_seconds
        return pipe

    @property
    def vae(self):
        """The fp32 VAE decoder, loaded on first use (a pipeline may only plan or generate tokens)."""
        if self._vae is None:
            if self.vae_dir is None:
                raise ValueError("this pipeline was built without a VAE directory; it cannot decode audio")
            self._vae = load_vae(self.vae_dir, device="cpu")
            if self.unified is not None:
                drop_page_cache(self.vae_dir)
        return self._vae

    def _hashed(self, directory: Path, what: str) -> dict:
        """The weights' identity, the hashing recorded as a start-up step (bytes read; 0 on hash-cache hits)."""
        with STARTUP.step("hashing", what, weights_bytes(directory)) as step:
            return model_identity(directory, hashes=self.hashes, verify=self.verify_hashes,
                                  on_block=block_counter(step))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the vLLM engine worker, if one runs (the torch models stay loaded), and any start of it in
        progress first (`stop_starting`)."""
        self.stop_starting(timeout)
        if self._vllm is not None:
            self._vllm.close()

    def stop_starting(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop any start of the engine in progress, in any thread: a derivation stops at its next block (its temp
        removed), a starting worker is killed and its `start` raises EngineStartAborted. Waits at most `timeout`
        seconds for the background start to end (a daemon thread). A running engine is left running."""
        from .engine.backend import EngineStartAborted

        self._stops += 1
        self._closing.set()
        try:
            if self._vllm is not None:
                self._vllm.abort_start()  # a start in a song's or the watchdog's thread
            if isinstance(self._join_prestart(timeout, abort=True), (StepAborted, EngineStartAborted)):
                self._prestart_error = None  # stopped, not failed: a later start goes ahead
        finally:
            self._closing.clear()  # a later song may start the engine again

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- AR backend selection

    def engine_settings(self, checkpoint) -> "EngineSettings":
        """The engine this pipeline starts: its options, sized against what the torch side keeps."""
        from .engine.backend import EngineSettings

        generation = self.generation_config
        typical = PROMPT_ESTIMATE_TOKENS + max(generation.abc.max_tokens, generation.semantic.max_tokens)
        mot_bytes = weights_bytes(self.model_dir) * DTYPES[self.dtype].itemsize // 2  # stored bf16
        vae_bytes = decoder_bytes(self.vae_config) if self.vae_config is not None else 0
        tile = vae_decode_bytes(self.vae_config, self.vae_core_frames, VAE_HALO_FRAMES) if self.vae_config else 0
        options = {"typical_tokens": typical, "offload_ar": self.offload_ar, "dtype": self.dtype,
                   "torch_side_bytes": mot_bytes + vae_bytes, "vae_tile_bytes": tile,
                   "torch_ar_on_device": self.ar_on_device, **self.engine_options}
        options.setdefault("cuda_visible_devices", engine_cuda_env(self.device).get("CUDA_VISIBLE_DEVICES"))
        if self.device.type == "cuda":
            options.setdefault("cuda_capability", tuple(torch.cuda.get_device_capability(self.device)))
            options.setdefault("unified", self.unified)
        if self.reproducible:
            from .engine.runner import batch_invariance

            capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else None
            options["batch_invariance"] = invariance = batch_invariance(self.device.type, capability)
            if invariance.dtype is not None:
                options["dtype"] = invariance.dtype
        return EngineSettings(checkpoint, device_type=self.device.type, memory_budget_gib=self.memory_budget_gib,
                              **options)

    def _check_split(self) -> None:
        """On a GPU, the split the engine would start with, refused (MemoryError naming the need, the limit and
        what to lower; on unified memory MemAvailable) before any weights are loaded. The AR checkpoint is
        estimated: the override's files, else the bf16 AR expert the derived checkpoint will hold."""
        config = YuE2Config.load(self.model_dir)
        override = Path(self.ar_checkpoint) if self.ar_checkpoint else None
        weights = weights_bytes(override) if override is not None and override.is_dir() else ar_expert_bytes(config)
        self.engine_settings(None).plan(config, engine_weights=weights).check()

    def _vllm_backend(self):
        """The vLLM backend, or None with the reason it cannot serve (decided once per pipeline, but for a failed
        start, which `select_ar_backend` tries again with `start_retry`'s backoff)."""
        with self._vllm_lock:
            if self._vllm is None and self._vllm_unavailable is None:
                from .quant.policy import resolve_ar_checkpoint
                from .engine.backend import VLLMBackend, unsupported_reason, vllm_version

                reason = unsupported_reason(vllm_version())
                if reason is None:
                    derived = not (self.ar_checkpoint or os.environ.get(OVERRIDE_ENV))
                    with STARTUP.step("deriving", "AR checkpoint",
                                      derivation_bytes(self.model_dir) if derived else None) as step:
                        checkpoint = resolve_ar_checkpoint(self.model_dir, override=self.ar_checkpoint,
                                                           device_type=self.device.type, hashes=self.hashes,
                                                           verify=self.verify_hashes,
                                                           quantized_policy=self.quantized_policy,
                                                           on_block=block_counter(step, self._closing))
                    if checkpoint.declined:
                        LOG.info("AR checkpoint: %s", checkpoint.declined)
                    reason = checkpoint.unservable
                if reason is not None:
                    self._vllm_unavailable = reason
                else:
                    self._vllm = VLLMBackend(YuE2Config.load(self.model_dir), self.engine_settings(checkpoint))
                    if not self._vllm.plan.ar_on_device and self._room is None:
                        self._room = DeviceRoom(self._vllm.plan.room, str(self.device))
            return self._vllm, self._vllm_unavailable

    def _start_engine_in_background(self) -> None:
        self._prestart_error = None
        done = threading.Event()
        self._prestart = threading.Thread(target=self._start_engine_early, args=(done,), name="yue2-engine-start",
                                          daemon=True)
        self._prestart.done = done
        self._prestart.start()

    def _start_engine_early(self, done: threading.Event) -> None:
        try:
            vllm, _ = self._vllm_backend()
            if vllm is not None and not self._closing.is_set():
                self._start_engine(vllm)
        except BaseException as exc:  # raised, or recorded as the fallback, when the first song asks
            self._prestart_error = exc
        finally:
            done.set()

    def _start_engine(self, vllm) -> None:
        with STARTUP.step("starting_engine", "vLLM engine"):
            vllm.start()

    def _join_prestart(self, timeout: float | None = None, abort: bool = False) -> BaseException | None:
        """Wait for the background engine start (at most `timeout` s); with `abort`, stop it meanwhile."""
        thread = self._prestart
        if thread is not None:
            # Waited on an Event, never Thread.join: a join that a signal interrupts (KeyboardInterrupt) marks a
            # live thread as ended in CPython 3.11 (it releases the thread's own lock), and close() would go on.
            deadline = None if timeout is None else time.monotonic() + timeout
            while not thread.done.is_set() and (deadline is None or time.monotonic() < deadline):
                if abort and self._vllm is not None:
                    self._vllm.abort_start()  # again each round: the backend may appear after a derivation
                thread.done.wait(0.1)
            if not thread.done.is_set():
                LOG.warning("the background engine start did not stop within %.0f s; leaving it", timeout)
                return self._prestart_error
            self._prestart = None
        return self._prestart_error

    @property
    def engine(self):
        """The vLLM backend when this pipeline serves the AR half on vLLM (None on the torch backend)."""
        return None if self.backend_requested == "torch" else self._vllm_backend()[0]

    def select_ar_backend(self, cfg_scale: float, legacy_off: bool) -> tuple[ARBackend, str | None]:
        """`(backend, fallback_reason)`: vLLM whenever it can serve, else torch with the reason why not.

        An engine that never started is a recorded fallback; one that died is restarted (bounded) and
        a song it cannot serve any more fails with `EngineError`, never silently on another backend.
        """
        if self.backend_requested == "torch":
            return self.torch_backend, None
        if (cfg_scale != 1.0 or legacy_off) and self.cfg_engine == "torch":
            what = f"cfg_scale {cfg_scale} ≠ 1" if cfg_scale != 1.0 else "cot=off legacy sampling"
            return self.torch_backend, f"{what}: paired CFG on vLLM is switched off (--cfg-engine torch)"
        from .engine.backend import EngineError, EngineStartAborted

        retry, stops = self.start_retry, self._stops
        with self._vllm_lock:
            if retry.retrying and self._prestart is not None and not self._prestart.done.is_set():
                return self.torch_backend, f"{retry.reason}; a new start is under way"
            if retry.due():  # a failed start is tried again in the background; songs keep to torch meanwhile
                retry.retrying, self._vllm_unavailable = True, None
                LOG.warning("retrying the vLLM engine start (failed %d time(s): %s)", retry.failures, retry.reason)
                self._start_engine_in_background()
                return self.torch_backend, f"{retry.reason}; a new start is under way"
        early = self._join_prestart()
        vllm, reason = self._vllm_backend()
        if vllm is not None and not vllm.running:
            try:
                if isinstance(early, (EngineError, MemoryError)) and not vllm.ever_started:
                    raise early  # the early start failed already: do not pay for a second try
                if self._stops != stops:  # the start this song waited for was stopped: no new one now
                    raise EngineStartAborted("the vLLM engine start was stopped (the pipeline is closing)")
                self._start_engine(vllm)
            except (EngineError, MemoryError) as exc:
                if vllm.ever_started or isinstance(exc, EngineStartAborted):
                    raise  # an aborted start is the pipeline closing, not a failure to retry
                with self._vllm_lock:  # the reason without the log tail (the log is kept and named in it)
                    reason = f"vLLM engine could not start: {str(exc).split('; log tail')[0]}"
                    self._vllm, self._vllm_unavailable = None, reason
                    self._room = None  # no engine beside us: the card is the torch side's (admission by free bytes)
                    self._prestart_error = None
                    self.start_retry.failed(reason)
                vllm.close()
                vllm = None
                LOG.warning("%s; songs run on the torch backend, the start is tried again in %.0f s", reason,
                            self.start_retry.backoff_s)
        if vllm is not None and vllm.running and self.start_retry.failures:
            self.start_retry.succeeded()
        return (vllm, None) if vllm is not None else (self.torch_backend, reason)

    def _generate_ar(self, prefix, sampling: Sampling, request: SongRequest, phase: str, **kwargs):
        backend, reason = self.select_ar_backend(kwargs.get("cfg_scale", 1.0), kwargs.get("legacy_off", False))
        if reason is not None:
            LOG.info("%s phase: torch backend (%s)", phase, reason)
        if backend is self.torch_backend:
            with self.torch_lock, self._torch_ar_admitted(prefix, sampling, phase, kwargs):
                if self.proxy_mode:
                    prepare_ar_proxies(self.model, self.proxy_mode)  # idempotent; undone before each NAR stage
                ids, timing, truncated = backend.generate(prefix, sampling, request.seed, phase, **kwargs)
        else:
            ids, timing, truncated = backend.generate(prefix, sampling, request.seed, phase, **kwargs)
        timing = {**timing, "backend_requested": self.backend_requested, "fallback_reason": reason}
        timing.setdefault("batch_invariant", True)  # the torch backend serves one song per forward pass
        return ids, timing, truncated

    @contextlib.contextmanager
    def _torch_ar_admitted(self, prefix, sampling: Sampling, phase: str, kwargs: dict):
        """A torch-backend AR phase holds the AR expert on the device (placement owner; moved from host memory,
        counted, when it lives there) and, beside the engine, is admitted into the room for those weights and
        its CFG branches' K/V first."""
        branches = 2 if kwargs.get("cfg_scale", 1.0) != 1.0 or kwargs.get("legacy_off") else 1
        need = torch_decode_bytes(self.model.config, len(prefix) + sampling.max_tokens, branches)
        placement = placement_of(self.model)
        if placement.home == "host":
            need += ar_host_bytes(self.model.config, self.model.dtype.itemsize)
        with self._admitted(need, f"{phase} phase on the torch backend", (), kwargs.get("cancelled")), \
                placement.hold("device", f"{phase} phase (torch backend)"):
            yield

    @property
    def room(self) -> DeviceRoom | None:
        """Where songs' buffers are admitted (a discrete GPU beside the engine; None: nothing to admit into)."""
        return self._room

    def nar_need(self, semantics: Sequence[SemanticResult]) -> int:
        """Device bytes a NAR run of these songs takes beyond the resident weights (memory.nar_song_bytes): every
        chunk's prefix K/V and activations, and one streamed AR layer when the AR expert is in host memory."""
        from .protocol import chunk_ranges

        chunks = [len(s.plan.prefix) + (b - a) + 3 for s in semantics  # prefix, codec, end, 2 latent slots
                  for a, b in chunk_ranges(len(s.tokens), len(s.plan.prefix), self.generation_config.context)]
        return nar_song_bytes(self.model.config, chunks, streamed=not self.ar_on_device)

    @contextlib.contextmanager
    def _admitted(self, need: int, what: str, on_progress: "Sequence[OnProgress | None]" = (),
                  cancelled: Cancelled | None = None, records: Sequence[dict] = ()):
        """Hold `need` bytes of the room for a stage (a no-op without one); a wait is reported to its songs as
        progress of stage `<stage>_wait` (need, free bytes) and recorded."""
        room = self.room
        if room is None:
            yield
            return
        stage = what.split()[0]

        def waiting(need_bytes: int, free: int) -> None:
            for report in on_progress:
                if report is not None:
                    report(f"{stage}_wait", need_bytes, free)

        start = time.perf_counter()
        with room.admit(need, what, on_wait=waiting, cancelled=cancelled):
            for record in records:
                record.update({"room_need_bytes": need, "room_wait_seconds": time.perf_counter() - start})
            yield

    def _release_engine_for_nar(self) -> None:
        """Keep the engine across the NAR when the memory split fits (always on the CPU), else stop it."""
        keep = self.keep_engine
        if keep is None:
            keep = self.device.type == "cpu" or self._vllm is None or not self._vllm.plan.problems()
        if not keep:  # a start in progress (another song's) is waited for, not stopped
            self._join_prestart()
            if self._vllm is not None:
                self._vllm.close()

    # -- configuration

    def sampling_for(self, request_overrides: dict | Sampling | None, phase: str) -> Sampling:
        return self.rules.sampling_for(request_overrides, phase)

    def effective_config(self, request: SongRequest, abc_sampling=None, semantic_sampling=None) -> dict:
        generation = replace(self.generation_config, abc=self.sampling_for(abc_sampling, "abc"),
                             semantic=self.sampling_for(semantic_sampling, "semantic"))
        defaults = GenerationConfig().to_dict()
        overrides = sorted(f"{phase}.{key}" for phase in ("abc", "semantic")
                           for key, value in generation.to_dict()[phase].items() if defaults[phase][key] != value)
        overrides += sorted(key for key in ("ode_steps", "context") if getattr(generation, key) != defaults[key])
        if request.guidance != default_cfg_scale(request.cot):
            overrides.append("cfg_scale")
        return {
            "generation": generation.to_dict(), "overrides": overrides, "cot": request.cot,
            "cfg_scale": request.guidance,
            "cfg_negative": "instruction_only" if request.cot == "off" else "same_instruction_and_exact_abc",
            "backend": self.backend_requested, "cfg_engine": self.cfg_engine, "quantization": self.quantization,
            "quantization_status": self.quantization_status,
            "ar_checkpoint": None if self.backend_requested == "torch" else (self.ar_checkpoint and
                                                                          str(self.ar_checkpoint)) or "derived", "model_dtype": "bfloat16",
            "vae_dtype": "float32", "vae_decode": "halo_crop", "vae_core_frames": self.vae_core_frames,
            "vae_halo_frames": VAE_HALO_FRAMES, "device": str(self.device),
            "memory_budget_gib": self.memory_budget_gib, "offload_ar": self.offload_ar, "dtype": self.dtype,
            "decoder_release": self.vae_config.release_variant if self.vae_config else None,
            **({"reproducible": True} if self.reproducible else {}),  # absent: identities of earlier runs hold
        }

    def check_request(self, request: SongRequest, abc_sampling=None, semantic_sampling=None) -> None:
        self.rules.check_request(request, abc_sampling, semantic_sampling)

    def source_records(self) -> dict:
        """Where the weights were read from (a Hub repo's revision, commit and snapshot path, or the local
        directory): recorded beside the identity, not in it (the weights' sha256s are)."""
        return {name: source.record() if source is not None else None for name, source in self.sources.items()}

    def run_identity(self, request: SongRequest, config: dict) -> str:
        """The song's identity: request, effective config and all weights (upstream's request identity)."""
        return identity({"request": request.to_dict(), "config": config, "weights": self.weights})

    def latent_identity(self, request: SongRequest, config: dict) -> str:
        """What the plan, semantic and latent stages depend on: the song's identity without the VAE."""
        return identity({"request": request.to_dict(),
                         "config": {k: v for k, v in config.items() if k not in AUDIO_CONFIG_KEYS},
                         "weights": {"mot": self.weights["mot"]}})

    # -- stages

    def plan(self, request: SongRequest, *, abc_sampling=None, cancelled: Cancelled | None = None,
             on_token: OnToken | None = None) -> SymbolicPlan:
        if request.instrumental:  # upstream's recipe: plan, move the vocal melody to Ins, render the edited score
            steps = instrumental.plan_steps(request, lambda asked: self.plan(
                asked, abc_sampling=abc_sampling, cancelled=cancelled, on_token=on_token))
            plan = self.plan(steps.render)
            return replace(plan, timing={**plan.timing, **steps.timing}, instrumental=steps)
        if request.cot == "off":
            return SymbolicPlan(request, None, [], semantic_prompt(request, self.tokenizer),
                                {"seconds": 0.0, "output_tokens": 0})
        if request.abc is not None:
            abc_ids = self.tokenizer.encode(request.abc)
            return SymbolicPlan(request, request.abc, abc_ids, semantic_prompt(request, self.tokenizer, abc_ids),
                                {"seconds": 0.0, "output_tokens": 0, "external_prefix_tokens": len(abc_ids)})
        ids, timing, truncated = self._generate_ar(
            abc_prompt(request, self.tokenizer), self.sampling_for(abc_sampling, "abc"), request, "abc",
            on_token=on_token, cancelled=cancelled)
        return SymbolicPlan(request, self.tokenizer.decode(ids), ids, semantic_prompt(request, self.tokenizer, ids),
                            timing, truncated)

    def generate_semantic(self, plan: SymbolicPlan, *, sampling=None, cancelled: Cancelled | None = None,
                          on_token: OnToken | None = None) -> SemanticResult:
        request = plan.request
        check_token_ids(plan.prefix, "plan.prefix")  # 1.0 == 1 would pass the comparison below
        expected = semantic_prompt(request, self.tokenizer, check_abc_ids(plan.abc_ids) if request.cot != "off"
                                   else None)
        if plan.prefix != expected:
            raise ValueError("plan.prefix does not match the request and its abc ids")
        negative = None
        if request.guidance != 1.0:
            negative = negative_prompt(request, self.tokenizer, plan.abc_ids)
        ids, timing, truncated = self._generate_ar(
            plan.prefix, self.sampling_for(sampling, "semantic"), request, "semantic", negative=negative,
            cfg_scale=request.guidance, legacy_off=request.cot == "off", on_token=on_token, cancelled=cancelled)
        return SemanticResult(plan, [i - CODEC_OFFSET for i in ids], timing, truncated)

    def _prepare_nar(self) -> None:
        self._release_engine_for_nar()
        if self.proxy_mode:
            restore_ar(self.model)

    def synthesize(self, semantic: SemanticResult, *, cancelled: Cancelled | None = None,
                   on_progress: OnProgress | None = None) -> np.ndarray:
        """One song's latents `[T, 64]`: upstream's one-song path, bit for bit."""
        check_semantic(semantic)
        progress = (lambda done, total: on_progress("nar", done, total)) if on_progress else None
        record = semantic.synthesis
        with self._admitted(self.nar_need([semantic]), "nar of 1 song", [on_progress], cancelled, [record]), \
                self.torch_lock if self.proxy_mode else contextlib.nullcontext():
            self._prepare_nar()
            latents = nar_synthesize(self.model, semantic.plan.prefix, semantic.tokens, semantic.plan.request.seed,
                                     steps=self.generation_config.ode_steps, context=self.generation_config.context,
                                     cancelled=cancelled, on_progress=progress, offload_ar=self.offload_ar,
                                     record=record)
        return latents.numpy()

    def synthesize_many(self, semantics: Sequence[SemanticResult], *, cancelled: Sequence[Cancelled | None] = (),
                        on_progress: Sequence[OnProgress | None] = ()) -> list[np.ndarray | BaseException]:
        """Several songs' latents in one batched flow matching (within bf16 rounding of `synthesize`);
        per song its latents or the exception that ended it."""
        results: list[np.ndarray | BaseException | None] = [None] * len(semantics)
        songs, batched = [], []
        for index, semantic in enumerate(semantics):
            try:
                check_semantic(semantic)
            except ValueError as exc:  # that song fails alone
                results[index] = exc
                continue
            report = on_progress[index] if index < len(on_progress) else None
            songs.append(SongInput(semantic.plan.prefix, semantic.tokens, semantic.plan.request.seed,
                                   cancelled[index] if index < len(cancelled) else None,
                                   (lambda done, total, r=report: r("nar", done, total)) if report else None,
                                   semantic.synthesis))
            batched.append(index)
        chosen = [semantics[i] for i in batched]
        reports = [on_progress[i] for i in batched if i < len(on_progress)]
        with self._admitted(self.nar_need(chosen), f"nar of {len(chosen)} songs", reports, None,
                            [s.synthesis for s in chosen]), \
                self.torch_lock if self.proxy_mode else contextlib.nullcontext():
            self._prepare_nar()
            latents = synthesize_many(self.model, songs, steps=self.generation_config.ode_steps,
                                      context=self.generation_config.context, offload_ar=self.offload_ar)
        for index, result in zip(batched, latents):
            results[index] = result.numpy() if isinstance(result, torch.Tensor) else result
        return results

    def decode(self, latents: np.ndarray, *, cancelled: Cancelled | None = None,
               on_progress: OnProgress | None = None) -> np.ndarray:
        """`[T, 64]` latents → `[1920·T − 64, 2]` float32 audio clamped to [-1, 1]."""
        latents = torch.as_tensor(np.asarray(latents, dtype=np.float32))
        if latents.ndim != 2 or latents.shape[1] != self.vae.config.latent_dim:
            raise ValueError(f"latents must be [frames, {self.vae.config.latent_dim}], got {list(latents.shape)}")
        progress = (lambda done, total: on_progress("vae", done, total)) if on_progress else None
        tile = vae_decode_bytes(self.vae.config, self.vae_core_frames, VAE_HALO_FRAMES)
        with self._admitted(tile, "vae tile", [on_progress], cancelled), self._vae_on_device() as vae:
            audio = vae.decode_tiled(latents.T[None], core_frames=self.vae_core_frames,
                                     halo_frames=VAE_HALO_FRAMES, on_progress=progress, cancelled=cancelled)[0]
        if not torch.isfinite(audio).all():
            raise FloatingPointError("the VAE produced non-finite audio")
        return audio.clamp(-1, 1).T.contiguous().numpy()

    def _device_room(self) -> int | None:
        """Bytes songs' buffers may still take on the accelerator (None on the CPU): the room's free bytes
        beside the engine on a discrete GPU, the unified pool now (MemAvailable less the OS reserve, what the
        plan reads; cudaMemGetInfo under-reports there), else what this process can still allocate."""
        if self.device.type != "cuda":
            return None
        if self.room is not None:
            return self.room.free
        if self.unified is not None:
            return unified_pool().pool
        return cuda_free_bytes(self.device)

    @contextlib.contextmanager
    def _vae_on_device(self):
        """The fp32 VAE on the pipeline's device for one decode (on the CPU nothing moves).

        It stays there afterwards, as the memory plan budgets it beside the MoT. On a discrete GPU without the
        engine, when the device cannot hold one tile's working set (`memory.vae_decode_bytes`) plus the VAE,
        the AR expert leaves it for the decode (held on the host by its placement owner, which waits for any
        stage using it and brings it back after) and the VAE goes back to the CPU, also on errors and
        cancellation; allocator caches are emptied around it. Beside the engine the tile is admitted into the
        room and nothing moves; on unified memory nothing moves either (one pool).
        """
        vae = self.vae
        if self.device.type == "cpu":
            yield vae
            return
        resident = vae.decoder_device == self.device
        need = vae_decode_bytes(vae.config, self.vae_core_frames, VAE_HALO_FRAMES) + (0 if resident else
                                                                                      module_bytes(vae))
        room = self._device_room()
        # Beside the engine the tile was admitted into the room and the AR expert is in host memory already; on
        # unified memory a move to the host frees nothing (one pool): only a discrete GPU without an engine moves.
        movable = self.room is None and self.unified is None and placement_of(self.model).home == "device"
        move_ar = movable and room is not None and need > room
        self.vae_placement = {"device": str(self.device), "need_bytes": need, "room_bytes": room, "ar_moved": move_ar}
        with offloaded_ar(self.model, move_ar):
            try:
                if move_ar:
                    empty_cache(self.device)
                vae.to(self.device)
                yield vae
            finally:
                if move_ar:
                    vae.to("cpu")
                empty_cache(self.device)

    def __call__(self, request: SongRequest, *, abc_sampling=None, semantic_sampling=None,
                 cancelled: Cancelled | None = None, on_token: OnToken | None = None,
                 on_progress: OnProgress | None = None) -> SongResult:
        self.check_request(request, abc_sampling, semantic_sampling)
        config = self.effective_config(request, abc_sampling, semantic_sampling)
        start = time.perf_counter()
        plan = self.plan(request, abc_sampling=abc_sampling, cancelled=cancelled, on_token=on_token)
        semantic = self.generate_semantic(plan, sampling=semantic_sampling, cancelled=cancelled, on_token=on_token)
        nar_start = time.perf_counter()
        latents = self.synthesize(semantic, cancelled=cancelled, on_progress=on_progress)
        vae_start = time.perf_counter()
        audio = self.decode(latents, on_progress=on_progress)
        end = time.perf_counter()
        timing = {"abc": plan.timing, "semantic": semantic.timing, "nar_seconds": vae_start - nar_start,
                  "vae_seconds": end - vae_start, "load": self.load_timing, "e2e_seconds": end - start}
        return SongResult(semantic, latents, audio, SAMPLE_RATE, config, self.weights, timing,
                          self.run_identity(request, config))

    # -- resumable runs

    def generate_to(self, directory: str | os.PathLike, request: SongRequest, *, resume: bool = False,
                    abc_sampling=None, semantic_sampling=None, stage: str = "audio",
                    cancelled: Cancelled | None = None, on_token: OnToken | None = None,
                    on_progress: OnProgress | None = None, on_stage: OnStage | None = None,
                    synthesizer: Synthesizer | None = None, decoder: Decoder | None = None) -> dict:
        """Run into `directory`, checkpointing each stage; returns the `result.json` document
        (or, with `stage="plan"`, the plan record). Resuming redoes only stages that do not verify.

        `on_stage(stage, event, meta)` reports each stage as it starts (`"start"`), is reused from a
        verified checkpoint (`"reused"`) or finishes (`"done"`, with the stage's record). A song
        scheduler passes `synthesizer` / `decoder` to run those stages in its shared synthesis lane
        (defaults: `self.synthesize` / `self.decode`)."""
        if stage not in ("plan", "audio"):
            raise ValueError(f"stage must be 'plan' or 'audio', got {stage!r}")
        self.check_request(request, abc_sampling, semantic_sampling)  # before anything is written
        config = self.effective_config(request, abc_sampling, semantic_sampling)
        run_id = self.run_identity(request, config)
        # The directory belongs to the latents' identity, so a changed VAE redoes only the audio stage.
        latent_id = self.latent_identity(request, config)
        run = art.RunDirectory(directory)
        continued = run.start(latent_id, request.to_dict(), resume=resume)  # an earlier run goes on
        finished = run.verified_result(run_id)
        if finished is not None and stage == "audio":
            LOG.info("resuming: the finished song verifies, nothing to redo")
            return run.reuse_result(finished, art.STAGES)
        current = {"stage": "plan", "verified": []}  # verified: the stages a resume kept, until one is redone
        reused: list[str] = []  # the stages taken from verified checkpoints (result.json's stages_reused)

        def stage_meta(name: str, compute: Callable[[], tuple[dict[str, bytes], dict]]) -> dict:
            """The stage's recorded meta if it verifies; otherwise redo it (and forget later stages)."""
            current["stage"] = name
            stage_id = run_id if name == "audio" else latent_id
            meta = run.verified_stage(name, stage_id, *STAGE_RECORDS[name])
            if meta is None and continued and current["verified"] is not None:  # say what a resume keeps, once
                LOG.info("resuming: %s verified, redoing %s", ", ".join(current["verified"]) or "no stage", name)
                current["verified"] = None
            if meta is None:
                run.stop_claiming(name, latent_id, request.to_dict())  # before its record goes
                run.discard_from(name)
                if on_stage is not None:
                    on_stage(name, "start", None)
                files, meta = compute()
                run.write_stage(name, stage_id, files, meta)
                if on_stage is not None:
                    on_stage(name, "done", meta)
            else:
                if current["verified"] is not None:
                    current["verified"].append(name)
                reused.append(name)
                if on_stage is not None:
                    on_stage(name, "reused", meta)
            return meta

        def compute_plan():
            plan = self.plan(request, abc_sampling=abc_sampling, cancelled=cancelled, on_token=on_token)
            files = {"prefix.npy": art.npy_bytes(np.asarray(plan.prefix, np.int32)),
                     "abc_tokens.npy": art.npy_bytes(np.asarray(plan.abc_ids, np.int32))}
            if plan.abc is not None:
                files["score.abc"] = plan.abc.encode("utf-8")
            if plan.instrumental is not None:  # planned.abc, instrumental.json: each step of the recipe
                files.update(instrumental.plan_files(plan.instrumental))
                return files, {"abc": plan.abc, "timing": plan.timing, "truncated": plan.truncated,
                               "instrumental": plan.instrumental.record()}
            return files, {"abc": plan.abc, "timing": plan.timing, "truncated": plan.truncated}

        def compute_semantic():
            semantic = self.generate_semantic(plan, sampling=semantic_sampling, cancelled=cancelled,
                                              on_token=on_token)
            return ({"semantic.npy": art.npy_bytes(np.asarray(semantic.tokens, np.int32))},
                    {"timing": semantic.timing, "truncated": semantic.truncated})

        def compute_latents():
            start = time.perf_counter()
            latents = (synthesizer or self.synthesize)(semantic, cancelled=cancelled, on_progress=on_progress)
            return {"latent.npy": art.npy_bytes(latents)}, {"nar_seconds": time.perf_counter() - start,
                                                            "offload_ar": self.offload_ar,
                                                            "peak_memory_bytes": peak_memory_bytes(self.device),
                                                            **semantic.synthesis}

        def compute_audio():
            start = time.perf_counter()
            audio = (decoder or self.decode)(latents, cancelled=cancelled, on_progress=on_progress)
            return ({"audio.flac": art.flac_bytes(audio, SAMPLE_RATE)},
                    {"vae_seconds": time.perf_counter() - start, "samples": len(audio)})

        try:
            plan_meta = stage_meta("plan", compute_plan)
            plan = SymbolicPlan(instrumental.rendered_request(plan_meta, request), plan_meta["abc"],
                                art.load_npy(run.path / "abc_tokens.npy").astype(int).tolist(),
                                art.load_npy(run.path / "prefix.npy").astype(int).tolist(),
                                plan_meta["timing"], plan_meta["truncated"])
            run.set_state(latent_id, request.to_dict(), "planned")
            if stage == "plan":
                return {"status": "planned", "identity": run_id, "resumed": reused == ["plan"],
                        "stages_reused": list(reused), **plan_meta}
            semantic_meta = stage_meta("semantic", compute_semantic)
            tokens = art.load_npy(run.path / "semantic.npy").astype(int).tolist()
            if any(not 0 <= t < CODEC_SIZE for t in tokens):
                raise ValueError(f"{run.path / 'semantic.npy'}: holds ids outside the codec range")
            semantic = SemanticResult(plan, tokens, semantic_meta["timing"], semantic_meta["truncated"])
            run.set_state(latent_id, request.to_dict(), "semantic_generated")
            synthesis_meta = stage_meta("synthesis", compute_latents)
            latents = art.load_npy(run.path / "latent.npy")
            run.set_state(latent_id, request.to_dict(), "synthesized")
            audio_meta = stage_meta("audio", compute_audio)
            write_json_atomic(run.path / "request.json", request.to_dict())
            write_json_atomic(run.path / "config.json", config)
            timing = {"abc": plan.timing, "semantic": semantic.timing, "nar_seconds": synthesis_meta["nar_seconds"],
                      "vae_seconds": audio_meta["vae_seconds"], "load": self.load_timing}
            document = run.write_result({
                # resumed: as upstream, only a finished result reused untouched (reuse_result) says True
                "status": "complete", "identity": run_id, "resumed": False, "stages_reused": list(reused),
                **batch_record(plan.timing, semantic.timing),
                "sources": self.source_records(),
                "truncated": {"abc": plan.truncated, "semantic": semantic.truncated},
                "sample_rate": SAMPLE_RATE, "audio_seconds": audio_meta["samples"] / SAMPLE_RATE,
                "weights": self.weights, "timing": timing,
            })
        except BaseException as exc:
            cancelled_run = isinstance(exc, (InterruptedError, KeyboardInterrupt))
            state = "cancelled" if cancelled_run else FAILED_STATES[current["stage"]]
            try:
                run.set_state(latent_id, request.to_dict(), state, error=f"{type(exc).__name__}: {exc}")
            except OSError:  # e.g. the disk is still full: the original error is the one to report
                pass
            raise
        try:
            run.set_state(latent_id, request.to_dict(), "complete")
        except OSError as exc:  # result.json, the authority, is complete and verifies
            LOG.warning("%s: the song is complete but its run state could not be updated (%s)", run.path, exc)
        return document
