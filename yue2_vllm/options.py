"""What a pipeline is built from besides its weights, in five typed groups that the CLI, the server, the bench and
the Python API each build once and hand down as they are:

- `LoadOptions`: what is loaded besides the MoT and the VAE, and how the weights are checked;
- `AROptions`: how the AR half runs on either backend (which backend, its numerics, quantized forms, CFG songs);
- `EngineOptions`: the vLLM engine's own settings (rows, tokens per step, KV cache form, runner, its start);
- `DeviceOptions`: where the pipeline runs and how much of that device's memory it may take;
- `AdapterOptions`: the adapters (LoRA) it serves, registered by name when it is built (docs/adapters.md).

`YuE2Pipeline(model, vae, generation_config=..., load=..., ar=..., engine=..., device=..., adapters=...)` takes them;
it also takes upstream's flat constructor keywords, vLLM's `LLM` keywords and this project's earlier flat keywords
(`FLAT_KEYWORDS`), which `pipeline_options` maps onto the groups. What each option implies on a machine (the budget,
the VAE tile, the AR checkpoint, the KV form, the LoRA slots) is worked out once from them (song/resolved.py); the
pipeline keeps them, its defaults filled in, as one `PipelineOptions`. What one song asks for (its seed, length,
style) is its `SongRequest`, never an option here.

Each group checks its own fields when it is made: a bad value is a ValueError of one line naming the field
(`AROptions.backend must be one of ...`), before anything is resolved or loaded. What depends on the machine or on
several groups (a device this machine lacks, a KV form it cannot run, a budget above the card) the resolver checks.
Importing this module imports neither torch nor vLLM (the CLI's parser reads its choices).
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import TYPE_CHECKING

from .kv_cache import FORMS as KV_CACHE_FORMS
from .protocol import GenerationConfig

if TYPE_CHECKING:
    from .checkpoint import HashCache

BACKENDS = ("torch", "vllm", "auto")
DTYPES = ("bfloat16", "float32")  # float32: verification runs of both AR backends
QUANTIZATIONS = ("none", "auto", "int8", "fp8")  # the torch AR's load-time proxies (auto: as the checkpoint says)
QUANTIZED_POLICIES = ("auto", "force")  # a quantized AR without a fast kernel here: the bf16 one (auto), or anyway
CFG_ENGINES = ("vllm", "torch")  # where cfg_scale != 1 and cot=off songs run when the backend is vllm/auto
TORCH_EXECUTIONS = ("auto", "graph", "eager", "batched")  # batched: the capture-ready step run eagerly (diagnostic)
RUNNERS = ("auto", "v1", "v2")  # vLLM's model runner (engine/runner.py)


def _refuse(owner: str, name: str, words: str, value) -> None:
    raise ValueError(f"{owner}.{name} must be {words}, got {value!r}")


def _choice(owner: str, name: str, value, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        _refuse(owner, name, f"one of {choices}", value)


def _flag(owner: str, name: str, value, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        _refuse(owner, name, "True, False or None" if optional else "True or False", value)


def _count(owner: str, name: str, value) -> None:
    """None, or an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, Integral) or value < 1):
        _refuse(owner, name, "an integer >= 1 or None", value)


def _positive(owner: str, name: str, value) -> None:
    """None, or a finite number > 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value)
                              or not value > 0):
        _refuse(owner, name, "a positive number or None", value)


@dataclass(frozen=True)
class LoadOptions:
    """What is loaded besides the MoT and the VAE, and how the weights are checked."""

    ar_checkpoint: str | os.PathLike | None = None  # the AR checkpoint vLLM serves (an FP8/int8 export); None:
    # $YUE2_AR_CHECKPOINT, else the one derived from the MoT
    verify_hashes: bool = False  # re-hash the weights instead of trusting the size+mtime cache
    hash_cache: "HashCache | None" = field(default=None, compare=False)  # None: the default cache file

    def __post_init__(self):
        if self.ar_checkpoint is not None and (not isinstance(self.ar_checkpoint, (str, os.PathLike))
                                               or not os.fspath(self.ar_checkpoint)):
            _refuse("LoadOptions", "ar_checkpoint", "a directory or None", self.ar_checkpoint)
        _flag("LoadOptions", "verify_hashes", self.verify_hashes)
        if self.hash_cache is not None:
            from .checkpoint import HashCache

            if not isinstance(self.hash_cache, HashCache):
                _refuse("LoadOptions", "hash_cache", "a checkpoint.HashCache or None", self.hash_cache)


@dataclass(frozen=True)
class AROptions:
    """How the AR half runs: the backend (vLLM whenever it can serve with auto/vllm, else torch on the record), the
    numerics of both backends, the quantized forms, where CFG songs run, and whether a seed fixes a song under
    load."""

    backend: str = "torch"
    dtype: str = "bfloat16"
    quantization: str = "none"  # the torch backend's load-time proxies (model/torch_quant.py)
    quantized_policy: str = "auto"  # a quantized AR form without a kernel faster than bf16 on this device
    cfg_engine: str = "vllm"
    torch_execution: str = "auto"  # how the torch backend decodes (model/sampling.py)
    reproducible: bool = False  # a batch-invariant engine: a seed fixes the song whatever else it serves

    def __post_init__(self):
        for name, choices in (("backend", BACKENDS), ("dtype", DTYPES), ("quantization", QUANTIZATIONS),
                              ("quantized_policy", QUANTIZED_POLICIES), ("cfg_engine", CFG_ENGINES),
                              ("torch_execution", TORCH_EXECUTIONS)):
            _choice("AROptions", name, getattr(self, name), choices)
        _flag("AROptions", "reproducible", self.reproducible)


# EngineOptions' fields that EngineSettings (engine/backend.py) takes under the same name.
_ENGINE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "sliced_head", "runner", "start_timeout_s")
# The EngineSettings keywords EngineOptions.tuning takes: the engine's own, which no other option sets. This module
# may not import engine/ (nor vLLM or torch); tests/test_options.py checks these two tables against EngineSettings'
# fields, so a field added there is sorted into one of them.
ENGINE_TUNING = ("max_model_len", "kv_cache_bytes", "enforce_eager", "progress_timeout_s", "max_restarts",
                 "restart_window_s", "synthesis_batch", "threads", "kv_admission", "meminfo_path")
# The EngineSettings keywords the pipeline works out from other options (song/resolved.py: engine_settings), each
# with the option that sets it: tuning refuses them (they would win over, or clash with, what was worked out).
ENGINE_DERIVED = {
    "checkpoint": "LoadOptions.ar_checkpoint", "device_type": "DeviceOptions.device",
    "memory_budget_gib": "DeviceOptions.budget_gib", "dtype": "AROptions.dtype",
    "offload_ar": "DeviceOptions.offload_ar", "typical_tokens": "the generation config (its phases' max_tokens)",
    "torch_side_bytes": "the weights loaded (the MoT's and the VAE's bytes)",
    "vae_tile_bytes": "DeviceOptions.vae_core_frames",
    "torch_ar_on_device": "the resolved memory split (the device, the backend and AROptions.quantization)",
    "cuda_visible_devices": "DeviceOptions.device", "cuda_capability": "DeviceOptions.device (its GPU)",
    "unified": "DeviceOptions.device (its memory)", "batch_invariance": "AROptions.reproducible",
    "lora": "AdapterOptions.max_loras and AdapterOptions.max_lora_rank",
}


def _tuning_problem(key: str) -> str | None:
    """Why `key` is no EngineOptions.tuning keyword (None: it is one)."""
    if key in ENGINE_TUNING:
        return None
    if key in ENGINE_DERIVED:
        return f"the pipeline works it out from {ENGINE_DERIVED[key]}; set that instead"
    return f"not an engine setting tuning takes (one of {', '.join(ENGINE_TUNING)})"


@dataclass(frozen=True)
class EngineOptions:
    """The vLLM engine's settings. None: sized by the memory plan (rows) or the engine's default. `tuning` holds
    the engine's other `EngineSettings` keywords (ENGINE_TUNING: tests and benchmarks: max_restarts, kv_cache_bytes,
    ...; they win over the sized ones); one another option sets (ENGINE_DERIVED) or no engine setting is refused,
    naming it."""

    kv_cache_dtype: str = "auto"  # the KV cache form (kv_cache.py): auto (the model dtype) or an FP8 form
    max_num_seqs: int | None = None  # engine rows
    max_num_batched_tokens: int | None = None  # tokens per engine step
    sliced_head: bool = True  # each row's logits over its phase's ids only (engine/ar_model.py)
    runner: str = "auto"
    start_timeout_s: float | None = None  # give up a start after this long (startup.py)
    start: bool = False  # start the engine while the MoT loads (else when the first song asks)
    keep: bool | None = None  # keep the engine across the NAR (None: when the memory split fits)
    tuning: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self):
        _choice("EngineOptions", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_FORMS)
        _count("EngineOptions", "max_num_seqs", self.max_num_seqs)
        _count("EngineOptions", "max_num_batched_tokens", self.max_num_batched_tokens)
        _flag("EngineOptions", "sliced_head", self.sliced_head)
        _choice("EngineOptions", "runner", self.runner, RUNNERS)
        _positive("EngineOptions", "start_timeout_s", self.start_timeout_s)
        _flag("EngineOptions", "start", self.start)
        _flag("EngineOptions", "keep", self.keep, optional=True)
        if not isinstance(self.tuning, Mapping) or not all(isinstance(key, str) for key in self.tuning):
            _refuse("EngineOptions", "tuning", "a mapping of EngineSettings keywords", self.tuning)
        named = sorted({f.name for f in fields(self)} & set(self.tuning))
        if named:
            raise ValueError(f"EngineOptions.tuning[{named[0]!r}]: set EngineOptions.{named[0]} instead")
        for key in self.tuning:
            problem = _tuning_problem(key)
            if problem is not None:
                raise ValueError(f"EngineOptions.tuning[{key!r}]: {problem}")
        object.__setattr__(self, "tuning", dict(self.tuning))  # a copy: the caller's dict may change later

    def settings(self) -> dict:
        """The EngineSettings keywords these options set (a None leaves the engine's default or sizing)."""
        named = {name: getattr(self, name) for name in _ENGINE_SETTINGS if getattr(self, name) is not None}
        return {**named, **self.tuning}


@dataclass(frozen=True)
class DeviceOptions:
    """Where the pipeline runs and how much of that device's memory it may take."""

    device: str = "auto"  # auto (CUDA if available, else MPS, else CPU), cpu, cuda, cuda:N or mps (or a torch.device)
    budget_gib: float | None = None  # None: a discrete GPU's memory less 10 %, unified memory's pool, on the CPU
    # 24 or the machine's memory less 10 %, the lesser (memory.default_budget_gib)
    offload_ar: bool = False  # the AR expert leaves the accelerator during the NAR's ODE steps (16-24 GB cards)
    vae_core_frames: int | None = None  # VAE tile size; None: 512 under a 12 GiB budget, else 1024

    def __post_init__(self):
        torch = sys.modules.get("torch")  # a torch.device (upstream takes one) is its name; torch is not imported here
        if torch is not None and isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        if not isinstance(self.device, str) or not self.device:
            _refuse("DeviceOptions", "device", "a device name (auto, cpu, cuda, cuda:N or mps)", self.device)
        _positive("DeviceOptions", "budget_gib", self.budget_gib)
        _flag("DeviceOptions", "offload_ar", self.offload_ar)
        _count("DeviceOptions", "vae_core_frames", self.vae_core_frames)


DEFAULT_MAX_LORAS = 4  # vLLM LoRA slots when AR adapters are registered and none is asked for (the plan may lower it)


@dataclass(frozen=True)
class AdapterOptions:
    """The adapters the pipeline serves: `modules` `(name, path or Hub id)` pairs, registered (read, checked and
    converted) when the pipeline is built. With any AR part among them the vLLM engine runs LoRA: `max_loras` slots
    (adapters per engine step; None: as many as AR adapters, at most DEFAULT_MAX_LORAS, fewer where the memory plan
    needs it) of `max_lora_rank` (None: what the registered adapters need). `instrumental` names the adapter that
    `instrumental: true` songs use (its card's recipe) instead of upstream's recipe."""

    modules: tuple = ()
    max_loras: int | None = None
    max_lora_rank: int | None = None
    instrumental: str | None = None
    cache_dir: str | os.PathLike | None = None  # the conversion cache (None: yue2-vllm's cache)

    def __post_init__(self):
        modules = tuple(tuple(pair) for pair in self.modules) if isinstance(self.modules, (list, tuple)) else None
        if modules is None or not all(len(pair) == 2 and all(isinstance(x, (str, os.PathLike)) for x in pair)
                                      for pair in modules):
            _refuse("AdapterOptions", "modules", "(name, path) pairs", self.modules)
        names = [name for name, _ in modules]
        if len(set(names)) != len(names):
            _refuse("AdapterOptions", "modules", "pairs with distinct names", names)
        object.__setattr__(self, "modules", tuple((str(name), os.fspath(path)) for name, path in modules))
        _count("AdapterOptions", "max_loras", self.max_loras)
        _count("AdapterOptions", "max_lora_rank", self.max_lora_rank)
        if self.instrumental is not None and self.instrumental not in names:
            _refuse("AdapterOptions", "instrumental", f"one of the registered names {names}", self.instrumental)


@dataclass(frozen=True)
class PipelineOptions:
    """All of one pipeline's options: what `YuE2Pipeline` keeps, its defaults filled in by the resolver
    (song/resolved.py: the device resolved, the budget, the VAE tile, the AR checkpoint override and the KV form
    decided)."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    load: LoadOptions = field(default_factory=LoadOptions)
    ar: AROptions = field(default_factory=AROptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    device: DeviceOptions = field(default_factory=DeviceOptions)
    adapters: AdapterOptions = field(default_factory=AdapterOptions)

    def __post_init__(self):
        for name, kind in (("generation", GenerationConfig), ("load", LoadOptions), ("ar", AROptions),
                           ("engine", EngineOptions), ("device", DeviceOptions), ("adapters", AdapterOptions)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be of type {kind.__name__}, got {type(getattr(self, name)).__name__}")


# Upstream's `backend` values beside ours: torch-eager is our torch backend decoding eagerly.
FLAT_BACKENDS = ("torch", "torch-eager", "vllm", "auto")
_GROUPS = {"load": LoadOptions, "ar": AROptions, "engine": EngineOptions, "device": DeviceOptions,
           "adapters": AdapterOptions}
# The flat keywords the pipeline takes besides the groups, each onto the field of one group (docs/usage.md's table):
# upstream's constructor's (device, memory_budget_gib, backend, verify_hashes, vae_core_frames, quantization,
# offload_ar; a later upstream's offload_nar), vLLM's `LLM`'s (kv_cache_dtype, max_num_seqs, max_num_batched_tokens,
# dtype, enforce_eager, max_model_len, max_loras, max_lora_rank), ours (sliced_head) and this project's earlier
# release's (hash_cache, ar_checkpoint, keep_engine, start_engine, cfg_engine, quantized_policy, reproducible,
# torch_execution, engine_options). "tuning": an EngineSettings keyword of EngineOptions.tuning.
FLAT_KEYWORDS = {
    "device": ("device", "device"), "memory_budget_gib": ("device", "budget_gib"),
    "vae_core_frames": ("device", "vae_core_frames"), "offload_ar": ("device", "offload_ar"),
    "offload_nar": ("device", "offload_ar"),
    "backend": ("ar", "backend"), "quantization": ("ar", "quantization"), "dtype": ("ar", "dtype"),
    "quantized_policy": ("ar", "quantized_policy"), "cfg_engine": ("ar", "cfg_engine"),
    "torch_execution": ("ar", "torch_execution"), "reproducible": ("ar", "reproducible"),
    "verify_hashes": ("load", "verify_hashes"), "ar_checkpoint": ("load", "ar_checkpoint"),
    "hash_cache": ("load", "hash_cache"),
    "kv_cache_dtype": ("engine", "kv_cache_dtype"), "max_num_seqs": ("engine", "max_num_seqs"),
    "max_num_batched_tokens": ("engine", "max_num_batched_tokens"), "sliced_head": ("engine", "sliced_head"),
    "start_engine": ("engine", "start"), "keep_engine": ("engine", "keep"),
    "enforce_eager": ("engine", "tuning"), "max_model_len": ("engine", "tuning"),
    "engine_options": ("engine", "tuning"),
    "max_loras": ("adapters", "max_loras"), "max_lora_rank": ("adapters", "max_lora_rank"),
}


# engine_options' keys that another group's field holds now, as the flat keywords of those names set it (vLLM's
# `dtype`, upstream's `offload_ar`): the earlier release passed them to the engine alone.
_ENGINE_OPTIONS_ELSEWHERE = {"dtype": ("ar", "dtype"), "offload_ar": ("device", "offload_ar")}


def backend_fields(value) -> dict[str, str]:
    """The AROptions fields one of upstream's backend values (FLAT_BACKENDS) sets: `torch-eager` is the torch
    backend decoding eagerly (the Python API's `backend=` and the CLI's `--backend`)."""
    if not isinstance(value, str) or value not in FLAT_BACKENDS:
        raise ValueError(f"backend must be one of {FLAT_BACKENDS}, got {value!r}")
    return {"backend": "torch", "torch_execution": "eager"} if value == "torch-eager" else {"backend": value}


def _flat_fields(keyword: str, value) -> list[tuple[str, str, str, object]]:
    """The `(group, field, label, value)`s one flat keyword sets (field `tuning[...]`: an EngineOptions.tuning
    entry; label: what a bad value's message names, the keyword or the `engine_options[...]` entry)."""
    group, name = FLAT_KEYWORDS[keyword]
    if keyword == "backend":
        return [(group, field, keyword, item) for field, item in backend_fields(value).items()]
    if keyword == "engine_options":  # the earlier release's EngineSettings keywords: the named ones are fields now
        if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
            raise ValueError(f"engine_options must be a mapping of EngineSettings keywords, got {value!r}")
        named = {*_ENGINE_SETTINGS, "kv_cache_dtype"}
        return [(*_ENGINE_OPTIONS_ELSEWHERE.get(key, (group, key if key in named else f"tuning[{key}]")),
                 f"engine_options[{key!r}]", item) for key, item in value.items()]
    return [(group, f"tuning[{keyword}]" if name == "tuning" else name, keyword, value)]


def pipeline_options(generation_config: GenerationConfig | Mapping | None = None, *,
                     load: LoadOptions | None = None, ar: AROptions | None = None,
                     engine: EngineOptions | None = None, device: DeviceOptions | str | None = None,
                     adapters: AdapterOptions | None = None, **flat) -> PipelineOptions:
    """The options the pipeline's keywords give: the groups as they are, each group not given built from the flat
    keywords that set its fields (FLAT_KEYWORDS; `device` is a group or upstream's device name). A flat keyword whose
    group is given too, two keywords that set one field, and an unknown keyword are a TypeError of one line naming
    them, as Python's for a bad keyword; a bad value is the group's ValueError, naming the keyword."""
    if device is not None and not isinstance(device, DeviceOptions):
        flat = {"device": device, **flat}
        device = None
    unknown = [keyword for keyword in flat if keyword not in FLAT_KEYWORDS]
    if unknown:
        raise TypeError(f"YuE2Pipeline() got an unexpected keyword argument {unknown[0]!r}")
    given = {"load": load, "ar": ar, "engine": engine, "device": device, "adapters": adapters}
    fields: dict[str, dict] = {group: {} for group in given}
    set_by: dict[tuple[str, str], str] = {}
    labels: dict[tuple[str, str], str] = {}  # what a bad value of each field names
    for keyword, value in flat.items():
        if keyword == "offload_nar":  # upstream: offload_ar = offload_ar or offload_nar (the NAR's placement is ours)
            if given["device"] is not None:
                raise TypeError("YuE2Pipeline() got 'offload_nar' both as a keyword and in device= (DeviceOptions); "
                                "give it in one place")
            if not isinstance(value, bool):
                raise ValueError(f"offload_nar must be True or False, got {value!r}")
            continue
        for group, name, label, item in _flat_fields(keyword, value):
            if given[group] is not None:
                raise TypeError(f"YuE2Pipeline() got {label if label != keyword else repr(keyword)} both as a "
                                f"keyword and in {group}= ({_GROUPS[group].__name__}); give it in one place")
            other = set_by.setdefault((group, name), keyword)
            if other != keyword:
                raise TypeError(f"YuE2Pipeline() got {other!r} and {keyword!r}, which both set "
                                f"{_GROUPS[group].__name__}.{name}; give one of them")
            fields[group][name] = item
            labels[(group, name)] = label
    if flat.get("offload_nar") and not fields["device"].get("offload_ar"):
        fields["device"]["offload_ar"] = True
        labels.setdefault(("device", "offload_ar"), "offload_nar")
    built = {}
    for group, kind in _GROUPS.items():
        if given[group] is not None:
            built[group] = given[group]
            continue
        values = {name: item for name, item in fields[group].items() if not name.startswith("tuning[")}
        tuning = {name[7:-1]: item for name, item in fields[group].items() if name.startswith("tuning[")}
        try:
            built[group] = kind(**values, **({"tuning": tuning} if tuning else {}))
        except ValueError as exc:  # name the keyword (or engine_options entry) the bad value came from
            message = str(exc)
            for name in fields[group]:
                prefix = (f"{kind.__name__}.tuning[{name[7:-1]!r}]:" if name.startswith("tuning[")
                          else f"{kind.__name__}.{name} ")
                if message.startswith(prefix):
                    message = labels[(group, name)] + prefix[-1] + message[len(prefix):]
            raise ValueError(message) from None
    generation = (generation_config if isinstance(generation_config, GenerationConfig)
                  else GenerationConfig.from_dict(generation_config))
    return PipelineOptions(generation, **built)
