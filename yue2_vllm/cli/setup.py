"""What every song command shares: the request from flags and files, the `SongSetup` read from the model flags once
(the weights by their names, the generation config, the pipeline's options) and the pipeline built from it, the
JSON status line.
"""
from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ..kv_cache import FLAG as KV_FLAG
from ..options import (AdapterOptions, AROptions, DeviceOptions, EngineOptions, LoadOptions, PipelineOptions,
                       backend_fields)
from ..protocol import GenerationConfig
from ..request_json import UsageError, read_abc, read_json_file, read_text_file, request_from_json

def write_json_atomic(path, value) -> None:
    """checkpoint.write_json_atomic, imported on first use: `yue2-vllm --help` must not import torch."""
    from ..checkpoint import write_json_atomic as write

    write(path, value)


DEFAULT_REQUEST = {
    "id": "first_song",
    "style": "华语流行, 钢琴, 温暖的女声, 抒情, 慢节奏",
    "lyrics": "[verse]\n窗外的雨轻轻落下\n我把思念写成一首歌\n[chorus]\n你是我心里最温柔的光\n",
}


# Failures a user can act on from the message alone (a traceback would only hide it).
EXPECTED_ERRORS = (ValueError, OSError, InterruptedError)


def build_request(args, song_adapters: tuple = ()) -> tuple[object, dict, object | None]:
    """The request from --request / the flags / the default, its sampling overrides and, for a cover, its
    Transcription (else None): a --melody-audio (or the request file's melody_audio) is transcribed here, before
    any model loads, and its score is the song's (cli.transcribe.cover_of). `song_adapters`: the `--lora` adapters'
    (name, scale) (`adapter_options`, parsed once), every song's unless its request file names its own."""
    from ..cover import COVER_COT, cover_request
    from ..protocol import SongRequest
    from .transcribe import cover_of, flag_knobs

    data, base_dir, where = {}, None, "request"
    if args.request:
        path = Path(args.request)
        data, base_dir, where = read_json_file(path, "--request"), path.parent, f"--request {path}"
    elif args.style is None and args.lyrics is None and args.lyrics_file is None \
            and getattr(args, "melody_audio", None) is None:
        data = dict(DEFAULT_REQUEST)
    fields, overrides = request_from_json(data, base_dir, where)
    melody = melody_flags(args, fields.pop("melody_audio", None), fields, where)
    flags = {"style": "--style", "lyrics": "--lyrics", "cot": "--cot", "seed": "--seed", "cfg_scale": "--cfg-scale",
             "id": "--id", "seconds": "--seconds"}
    flag_values = {name: getattr(args, name, None) for name in flags}
    if args.lyrics_file:
        flags["lyrics"], flag_values["lyrics"] = "--lyrics-file", read_text_file(Path(args.lyrics_file),
                                                                                 "--lyrics-file")
    if args.abc_file:
        flags["abc"], flag_values["abc"] = "--abc-file", read_abc(Path(args.abc_file), "--abc-file")
    if getattr(args, "instrumental", None):
        flags["instrumental"], flag_values["instrumental"] = "--instrumental", True
    if song_adapters and "adapters" not in data:  # --lora, unless the request file names its own
        flags["adapters"], flag_values["adapters"] = "--lora", [
            {"name": name, "scale": scale} for name, scale in song_adapters]
    given = {k: v for k, v in flag_values.items() if v is not None}
    fields.update(given)
    if melody is not None and fields.get("cot", COVER_COT) != COVER_COT:
        raise UsageError(f"{flags['cot'] if 'cot' in given else where}: a cover renders its transcribed melody with "
                         f"cot {COVER_COT!r}, got {fields['cot']!r}")
    if fields.get("instrumental") is True:
        fields.setdefault("lyrics", "")  # lyrics are optional for an instrumental
    for name in ("style", "lyrics"):
        if name not in fields:
            raise UsageError(f"request: missing '{name}' (give --{name} or a --request file)")

    def make(values: dict, transcription) -> SongRequest:
        try:
            if transcription is not None:
                return cover_request(transcription, **values)
            return SongRequest(**values)
        except ValueError as exc:  # name the flag or the file the bad value came from
            field = re.match(r"SongRequest\.(\w+)", str(exc))
            source = flags[field.group(1)] if field and field.group(1) in given else where
            raise UsageError(f"{source}: {exc}", exc) from None

    if melody is None:
        return make(fields, None), overrides, None
    request, transcription = cover_of(fields, melody, make, tuple(flag_knobs(args)))
    return request, overrides, transcription


def melody_flags(args, melody, fields: dict, where: str):
    """A cover's melody: the request file's `melody_audio` (a MelodyAudio) with --melody-audio and the knob flags
    over it; a knob flag without a melody, or a melody beside a score (--abc-file, the file's abc), is refused
    naming both. None when the song is no cover."""
    from dataclasses import replace as changed

    from ..request_json import MelodyAudio
    from .transcribe import KNOB_FLAGS, flag_knobs

    knobs = flag_knobs(args)
    audio = getattr(args, "melody_audio", None)
    if audio is not None:
        for name in ("abc", "transcription"):
            if name in fields:
                raise UsageError(f"--melody-audio: {where} gives the song's score ('{name}'); a cover's score is "
                                 "the transcription of --melody-audio: give one of them")
        melody = MelodyAudio(Path(audio), {**(melody.knobs if melody else {}), **knobs}, "--melody-audio")
        fields.setdefault("cot", "melody")
    elif melody is not None:
        melody = changed(melody, knobs={**melody.knobs, **knobs})
    elif knobs:
        raise UsageError(f"{KNOB_FLAGS[next(iter(knobs))]}: sets how --melody-audio is transcribed; give "
                         "--melody-audio")
    if melody is not None and args.abc_file:
        raise UsageError(f"--abc-file: give --abc-file or a melody to transcribe ({melody.where}), not both")
    return melody


def print_status(status: dict, stream=None) -> None:
    """One JSON status line on stdout (or `stream`)."""
    from ..checkpoint import json_text

    print(json_text(status), file=stream or sys.stdout, flush=True)


@dataclass(frozen=True)
class Weights:
    """The MoT and the VAE as a command's flags name them (upstream's names, see model_names; `model` None: the
    embedded tiny default), resolved where the pipeline loads: a Ray head reads configs only, its replicas the
    weights."""

    model: str | None = None
    vae: str | None = None
    revision: str | None = None
    vae_revision: str | None = None
    progress: bool = True  # huggingface_hub's download bars on stderr (--quiet: off)

    @classmethod
    def of(cls, args, need_vae: bool = True) -> "Weights":
        names = model_names(args, need_vae)
        if names is None:
            return cls()
        return cls(*names, getattr(args, "revision", None), getattr(args, "vae_revision", None),
                   progress=not getattr(args, "quiet", False))

    def resolve(self, patterns: tuple | None = None) -> tuple:
        """`(model, vae)`: the tiny default's directories, else local directories or Hugging Face repo ids resolved
        to their cached snapshots of `patterns` (default: everything the loaders read), each error naming its
        flag."""
        from ..hub import HubOptions, is_local_name, resolve_model
        from ..testing import tiny_default

        if self.model is None:
            return tiny_default()
        hub = HubOptions(progress=self.progress)
        sources = []
        for flag, name, revision in (("--model", self.model, self.revision), ("--vae", self.vae, self.vae_revision)):
            if name is None:
                sources.append(None)
                continue
            if is_local_name(name) and not Path(name).expanduser().is_dir():
                raise UsageError(f"{flag} {name}: " + ("is not a directory" if Path(name).expanduser().exists()
                                                       else "does not exist"))
            sources.append(resolve_model(name, revision=revision, what=flag, hub=hub,
                                         **({"patterns": patterns} if patterns is not None else {})))
        return sources[0], sources[1]


@dataclass(frozen=True)
class SongSetup:
    """What a song command runs on, read from its flags once (`song_setup`): the weights, the generation config and
    the pipeline's options, passed down as they are to the pipeline, a Ray head's admission and every replica."""

    weights: Weights
    sources: tuple | None  # (model, vae) resolved on this machine; None: resolved where the pipeline is built
    generation: GenerationConfig
    load: LoadOptions
    ar: AROptions
    engine: EngineOptions
    device: DeviceOptions
    adapters: AdapterOptions = AdapterOptions()
    song_adapters: tuple = ()  # `--lora`: (name, scale) of the adapters every song of the run uses
    device_here: object | None = None  # --device as this machine resolved it (torch.device); None: a replica's

    @property
    def options(self) -> PipelineOptions:
        return PipelineOptions(self.generation, self.load, self.ar, self.engine, self.device, self.adapters)

    def resolved(self):
        """The options resolved on the machine the pipeline is built on (song.resolved.resolve_options), refusals
        naming the flags: --device there (once: this machine's was resolved by song_setup), --kv-cache-dtype,
        --budget, --torch-execution, --dtype."""
        from ..song.resolved import resolve_options

        device = self.device_here if self.device_here is not None else flag_device(self.device.device)
        return resolve_options(self.options, device, kv_flag=KV_FLAG)

    def pipeline(self):
        """The pipeline, its engine starting while the MoT loads, built from the options resolved on this machine
        (`resolved`: what it cannot do is refused first, naming the flag; a vLLM runner too)."""
        from ..pipeline import YuE2Pipeline

        resolved = self.resolved()
        model, vae = self.sources if self.sources is not None else self.weights.resolve()
        ar, engine = self.ar, self.engine
        if engine.runner != "auto":
            check_runner(engine.runner, resolved.device_type, ar.backend)
        pipe = YuE2Pipeline(model, vae, options=resolved)
        note = torch_ar_note(ar.backend, pipe.device.type, vllm_installed())
        if note is not None:
            import logging

            logging.getLogger("yue2_vllm").warning("%s", note)
        return pipe

    def for_replicas(self, concurrency: int) -> "SongSetup":
        """What each replica builds its pipeline from: the weights and the device resolved there, one engine row per
        song in flight unless --max-num-seqs says."""
        engine = replace(self.engine, max_num_seqs=self.engine.max_num_seqs or concurrency)
        return replace(self, sources=None, engine=engine, device_here=None)

    def admission(self, device_type: str) -> tuple:
        """What a server whose songs run on replicas needs of these weights, resolved here without the weight files
        (song_setup with HEAD_PATTERNS): `(SongRules, rows)` — the rules it admits songs by (the pipeline's, without
        loading any weights), and the songs one replica serves at once when --max-concurrency is not given (the
        engine's rows as the memory split on a replica's `device_type` sizes them beside the adapters' LoRA slots,
        as a replica resolves them; 1 on the torch backend)."""
        from ..protocol import SongRules
        from ..song.resolved import ar_adapters, resolve_options
        from ..tokenizer import YuE2Tokenizer

        model_dir, vae_dir = self.sources
        head_files(model_dir, vae_dir)
        listing, sizes = {}, (0, 0)
        if self.adapters.modules:  # the head reads and checks them too: it admits songs by their names
            from ..model.modeling import YuE2Config
            from ..song.adapters import ServedAdapters

            registered = ServedAdapters.register(self.adapters, YuE2Config.load(model_dir))
            listing, sizes = registered.listing(), ar_adapters(registered.registry)
        rules = SongRules(self.generation, YuE2Tokenizer.from_model_dir(model_dir), self.ar.reproducible, listing)
        if self.ar.backend == "torch" or (self.ar.backend == "auto" and not vllm_installed()):
            return rules, 1
        sized = replace(self.options, engine=replace(self.engine, max_num_seqs=None))  # rows as the split sizes them
        resolved = resolve_options(sized, device_type, kv_flag=None).with_adapters(*sizes)
        rows = split_plan(model_dir, vae_dir, resolved,
                          weights=head_weights_bytes(model_dir, vae_dir, self.weights.progress)).max_num_seqs
        return rules, rows


def song_setup(args, need_vae: bool = True, patterns: tuple | None = None, adapters: tuple | None = None) -> SongSetup:
    """A song command's `SongSetup` from its flags (the model flags, `--config`, --concurrency as the engine's rows):
    the embedded tiny default with its 10-second budgets when --model and --vae are both left out, else upstream's
    names (model_names); `--backend` left out is default_backend's choice for these weights. `adapters`: the
    adapter flags as `adapter_options` parsed them already (None: parsed here). --device is resolved here, once, on
    a machine that builds a pipeline itself (not a Ray head: `patterns`)."""
    from ..testing import TINY_GENERATION

    device_here = flag_device(args.device) if patterns is None else None
    if device_here is None:
        check_device(args.device)
    generation = read_json_file(Path(args.config), "--config") if args.config else None
    weights = Weights.of(args, need_vae)
    model_dir, vae_dir = weights.resolve(patterns)
    checkpoint = args.ar_checkpoint
    if weights.model is None:
        generation = generation or TINY_GENERATION  # a 10 s song, so the default run takes seconds
    elif checkpoint is not None and not Path(checkpoint).is_dir():
        raise UsageError(f"--ar-checkpoint {checkpoint}: " + ("is not a directory" if Path(checkpoint).exists()
                                                             else "does not exist"))
    try:
        generation = GenerationConfig.from_dict(generation)
    except ValueError as exc:
        raise UsageError(f"--config {args.config}: {exc}") from None
    return SongSetup(weights, (model_dir, vae_dir), generation,
                     *flag_options(args, args.backend or default_backend(model_dir)),
                     *(adapters if adapters is not None else adapter_options(args)), device_here=device_here)


def flag_options(args, backend: str) -> tuple[LoadOptions, AROptions, EngineOptions, DeviceOptions]:
    """The pipeline's options as a song command's flags set them, with `backend` for --backend (upstream's
    `torch-eager` too: the torch backend decoding eagerly); upstream's --offload-nar turns --offload-ar on."""
    fields = backend_fields(backend)
    execution = fields.pop("torch_execution", None)
    if execution is not None and args.torch_execution not in ("auto", execution):
        raise UsageError(f"--backend {backend}: is the torch backend decoding {execution}, and --torch-execution "
                         f"{args.torch_execution} asks otherwise; give one of them")
    ar = AROptions(**fields, dtype=args.dtype, quantization=args.quantization,
                   quantized_policy=args.quantized_policy, cfg_engine=args.cfg_engine,
                   torch_execution=execution or args.torch_execution, reproducible=args.reproducible)
    engine = EngineOptions(kv_cache_dtype=args.kv_cache_dtype,
                           # one engine row per song in flight (batch --concurrency, serve --max-concurrency)
                           max_num_seqs=args.max_num_seqs or getattr(args, "concurrency", None),
                           max_num_batched_tokens=args.max_num_batched_tokens, sliced_head=not args.no_sliced_head,
                           runner=args.vllm_runner, start_timeout_s=args.engine_start_timeout, start=True)
    return (LoadOptions(ar_checkpoint=args.ar_checkpoint, verify_hashes=args.verify_hashes), ar, engine,
            DeviceOptions(device=args.device, budget_gib=args.budget,
                          offload_ar=args.offload_ar or getattr(args, "offload_nar", False)))


def check_kv_flag(args, on_this_machine: bool = True) -> None:
    """The flags' options resolved before any weights are resolved or anything is printed (`serve`: before its
    "starting" line), refused naming the flag: --device and --kv-cache-dtype (song.resolved.resolve_options) on
    this machine; a Ray head checks what holds on any device (its replicas check their own). --backend left out
    counts as auto here: the tiny default's torch is checked where its pipeline is built."""
    from ..song.resolved import resolve_options

    load, ar, engine, device = flag_options(args, args.backend or "auto")
    options = PipelineOptions(load=load, ar=ar, engine=engine, device=device)
    resolve_options(options, flag_device(args.device) if on_this_machine else args.device, kv_flag=KV_FLAG)


def adapter_options(args) -> tuple[AdapterOptions, tuple]:
    """`(AdapterOptions, the --lora adapters' (name, scale))` from --lora-modules, --lora and their limits; a bad
    spec is a UsageError naming the flag (the adapters themselves are read when the pipeline is built)."""
    from ..adapters.registry import parse_lora_module, parse_lora_spec, spec_names
    from ..adapters.weights import AdapterError

    try:
        modules = [parse_lora_module(text) for text in getattr(args, "lora_modules", None) or ()]
        named = spec_names([parse_lora_spec(text) for text in getattr(args, "lora", None) or ()],
                           [name for name, _ in modules])
        modules += [(name, spec.source) for name, spec in named]  # named apart from the modules; a repeat once
        options = AdapterOptions(tuple(dict.fromkeys(modules)), getattr(args, "max_loras", None),
                                 getattr(args, "max_lora_rank", None), getattr(args, "instrumental_adapter", None))
    except (AdapterError, ValueError) as exc:
        message = str(exc).replace("AdapterOptions.instrumental", "--instrumental-adapter").replace(
            "AdapterOptions.modules", "--lora-modules")
        raise UsageError(message, exc) from None
    return options, tuple((name, spec.scale) for name, spec in named)


def check_device(device: str) -> None:
    """`--device`, refused (naming the flag) when this machine cannot run it."""
    from ..devices import device_problem

    problem = device_problem(device)
    if problem is not None:
        raise UsageError(f"--device {device}: {problem}")


def flag_device(device: str):
    """`--device` resolved on this machine (a torch.device), refused naming the flag when it cannot run it."""
    from ..devices import resolve_device

    check_device(device)
    return resolve_device(device)


def head_files(model_dir, vae_dir) -> dict:
    """What the Ray head's resolution left on this machine (the config, tokenizer and size files of a repo id, no
    weights), said in one line on stderr."""
    import logging

    from ..hub import ModelSource

    fetched = {name: source.fetched() for name, source in (("model", model_dir), ("vae", vae_dir))
               if isinstance(source, ModelSource) and source.repo_id is not None}
    if fetched:
        words = "; ".join(f"{entry['repo_id']}: {', '.join(entry['files']) or 'nothing'} ({entry['bytes']} bytes)"
                          for entry in fetched.values())
        logging.getLogger("yue2_vllm").warning("Ray head: resolved %s; the weights are the replicas' to fetch", words)
    return fetched


def head_weights_bytes(model_dir, vae_dir, progress: bool = True) -> tuple[int, int]:
    """`(MoT bytes, VAE bytes)` for the memory split without the weights here (hub.weights_bytes_of)."""
    from ..hub import HubOptions, ModelSource, weights_bytes_of
    from ..checkpoint import weights_bytes

    hub = HubOptions(progress=progress)

    def size(source) -> int:
        if source is None:
            return 0
        return weights_bytes_of(source, hub)[0] if isinstance(source, ModelSource) else weights_bytes(source)

    return size(model_dir), size(vae_dir)


def memory_plan(model_dir, vae_dir, device_type: str, device: DeviceOptions = DeviceOptions(),
                engine: EngineOptions = EngineOptions(), *, generation: GenerationConfig | None = None,
                weights: tuple[int, int] | None = None):
    """`split_plan` of these options resolved for `device_type` (song.resolved.resolve_options: the budget, the VAE
    tile, the KV form as given; `generation`: rows sized for its songs, default upstream's)."""
    from ..song.resolved import resolve_options

    options = PipelineOptions(generation or GenerationConfig(), device=device, engine=engine)
    return split_plan(model_dir, vae_dir, resolve_options(options, device_type, kv_flag=None), weights=weights)


def split_plan(model_dir, vae_dir, resolved, *, weights: tuple[int, int] | None = None):
    """The engine / torch split (memory.plan_memory) of these weights with these resolved options
    (song.resolved.ResolvedOptions: the device type, the budget, the unified pool, the VAE tile, the rows asked for,
    --offload-ar, the KV cache form counted by its element size, the typical song, the adapters' LoRA slots). On
    this machine's integrated GPU the split is one pool with the host (no budget: the pool). `weights`: the (MoT,
    VAE) file bytes where the files are not here (a Ray head), else they are read from the directories; the VAE is
    planned by its config.json, the release's where the directory has none (so the rows never hang on it)."""
    from ..checkpoint import read_json, weights_bytes
    from ..kv_cache import element_bytes
    from ..lora_memory import lora_slots_bytes
    from ..memory import ar_expert_bytes, plan_memory, vae_decode_bytes
    from ..model.modeling import YuE2Config
    from ..model.vae import VAEConfig, decoder_bytes
    from ..pipeline import VAE_HALO_FRAMES

    config = YuE2Config.load(Path(model_dir))
    vae, tile = 0, 0
    if vae_dir is not None:  # the decoder we keep, by its config (the release's where none is here yet)
        config_file = Path(vae_dir) / "config.json"
        vae_config = VAEConfig.from_dict(read_json(config_file)) if config_file.is_file() else VAEConfig()
        vae = decoder_bytes(vae_config)
        tile = vae_decode_bytes(vae_config, resolved.vae_core_frames, VAE_HALO_FRAMES)
    options, lora = resolved.options, resolved.lora
    return plan_memory(config, device=resolved.device_type, budget_gib=resolved.budget_gib,
                       engine_weights=ar_expert_bytes(config),
                       torch_model=weights[0] if weights else weights_bytes(model_dir), vae=vae, vae_tile=tile,
                       max_num_seqs=options.engine.max_num_seqs, offload_ar=options.device.offload_ar,
                       total=card_bytes(resolved.device_type, resolved.budget_gib), unified=resolved.unified,
                       kv_dtype_bytes=element_bytes(resolved.kv_cache_dtype), typical_tokens=resolved.typical_tokens,
                       lora_slots=lora_slots_bytes(config, lora.max_loras, lora.max_lora_rank))


def card_bytes(device_type: str, budget_gib: float) -> int | None:
    """A replica's device memory as far as this machine can tell: its own first GPU, or the budget when it has
    none (the head of a GPU cluster may have no GPU); None for host memory."""
    import torch

    if device_type != "cuda" or torch.cuda.is_available():
        return None
    return int(budget_gib * 2**30)


def check_runner(runner: str, device_type: str, backend: str) -> str:
    """`--vllm-runner`, refused before anything is written when this machine's vLLM cannot run it on `device_type`
    (the resolved --device's)."""
    if backend != "torch":
        from ..engine.backend import vllm_version
        from ..engine.runner import resolve_runner

        try:
            resolve_runner(runner, device_type, vllm_version())
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return runner


def model_names(args, need_vae: bool = True) -> tuple[str, str | None] | None:
    """`(model, vae)` as upstream's CLI names them, or None for the embedded tiny default (neither flag given).

    `--vae standard` / `legacy` are m-a-p/YuE2-Vae / m-a-p/YuE2-Vae-legacy; `--model` left out is m-a-p/YuE2-3B
    once `--vae` is given, and `--vae` left out is `standard` once `--model` is (None where the command
    decodes no audio). A `--revision` / `--vae-revision` without either flag is refused: the tiny default has
    no Hub revisions, and it is not silently dropped."""
    from ..hub import DEFAULT_MODEL, VAE_ALIASES

    model, vae = args.model, getattr(args, "vae", None)
    if model is None and vae is None:
        given = [flag for flag, name in (("--revision", "revision"), ("--vae-revision", "vae_revision"))
                 if getattr(args, name, None) is not None]
        if given:
            raise UsageError(f"{given[0]} names a Hub revision of --model / --vae; give --model or --vae (e.g. "
                             "--vae standard for m-a-p/YuE2-3B with m-a-p/YuE2-Vae): the embedded tiny default "
                             "has no revisions")
        return None
    if vae is None and need_vae:
        vae = "standard"
    return model or DEFAULT_MODEL, VAE_ALIASES.get(vae, vae)


def default_backend(model_dir) -> str:
    """`--backend` when not given: auto (vLLM whenever it can serve, else torch on the record) for real
    weights; torch for the tiny model, whose songs finish before a vLLM engine would have started."""
    from ..model.modeling import YuE2Config
    from ..testing import TINY_CONFIG

    try:
        return "torch" if YuE2Config.load(Path(model_dir)) == TINY_CONFIG else "auto"
    except (OSError, ValueError):  # the pipeline reports a broken checkpoint itself
        return "auto"


def vllm_installed() -> bool:
    from ..engine.backend import vllm_version

    return vllm_version() is not None


def torch_ar_note(backend: str, device_type: str, vllm_present: bool) -> str | None:
    """The one line shown when the AR half would run on our eager torch backend on a GPU only because vLLM
    is missing (several times slower there than vLLM), with how to install it; else None."""
    if backend == "torch" or device_type != "cuda" or vllm_present:
        return None
    from ..engine.backend import INSTALL_HINT

    return (f"vLLM is not installed: the AR half runs on the torch backend on CUDA, far slower than on vLLM; "
            f"install it with {INSTALL_HINT}")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the program is, so every stage unwinds as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _signal_name(exc: KeyboardInterrupt) -> str:
    return signal.Signals(getattr(exc, "signum", signal.SIGINT)).name


def _interrupt(signum, frame):
    """The first SIGINT / SIGTERM unwinds the program (the engine worker is killed, a derivation stops and removes
    its temp, the song is recorded as cancelled); a later one, arriving during that cleanup, ends the process at
    once (the engine worker dies with it, PR_SET_PDEATHSIG; a derivation's temp is removed by the next start)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_now)
    raise Interrupted(signum)


def _exit_now(signum, frame):
    import os

    try:
        os.write(2, f"yue2-vllm: {signal.Signals(signum).name} again: exiting now\n".encode())
    finally:
        os._exit(128 + signum)
