"""What every song command shares: the request from flags and files, the pipeline from the model
flags (backend, runner, hub ids), the JSON status line.
"""
from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

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


def build_request(args) -> tuple[object, dict]:
    from ..protocol import SongRequest

    data, base_dir, where = {}, None, "request"
    if args.request:
        path = Path(args.request)
        data, base_dir, where = read_json_file(path, "--request"), path.parent, f"--request {path}"
    elif args.style is None and args.lyrics is None and args.lyrics_file is None:
        data = dict(DEFAULT_REQUEST)
    fields, overrides = request_from_json(data, base_dir, where)
    flags = {"style": "--style", "lyrics": "--lyrics", "cot": "--cot", "seed": "--seed", "cfg_scale": "--cfg-scale",
             "id": "--id"}
    flag_values = {name: getattr(args, name) for name in flags}
    if args.lyrics_file:
        flags["lyrics"], flag_values["lyrics"] = "--lyrics-file", read_text_file(Path(args.lyrics_file),
                                                                                 "--lyrics-file")
    if args.abc_file:
        flags["abc"], flag_values["abc"] = "--abc-file", read_abc(Path(args.abc_file), "--abc-file")
    if getattr(args, "instrumental", None):
        flags["instrumental"], flag_values["instrumental"] = "--instrumental", True
    given = {k: v for k, v in flag_values.items() if v is not None}
    fields.update(given)
    if fields.get("instrumental") is True:
        fields.setdefault("lyrics", "")  # lyrics are optional for an instrumental
    for name in ("style", "lyrics"):
        if name not in fields:
            raise UsageError(f"request: missing '{name}' (give --{name} or a --request file)")
    try:
        return SongRequest(**fields), overrides
    except ValueError as exc:  # name the flag or the file the bad value came from
        field = re.match(r"SongRequest\.(\w+)", str(exc))
        source = flags[field.group(1)] if field and field.group(1) in given else where
        raise UsageError(f"{source}: {exc}", exc) from None


def print_status(status: dict, stream=None) -> None:
    """One JSON status line on stdout (or `stream`)."""
    from ..checkpoint import json_text

    print(json_text(status), file=stream or sys.stdout, flush=True)


def _models(args, need_vae: bool = True, patterns: tuple | None = None) -> tuple:
    """`(model_dir, vae_dir, generation config, backend)` from the model flags (the embedded tiny default with
    its 10-second budgets when --model and --vae are both left out; else upstream's names, see model_names)."""
    from ..pipeline import device_problem
    from ..protocol import GenerationConfig
    from ..testing import TINY_GENERATION, tiny_default

    problem = device_problem(args.device)
    if problem is not None:
        raise UsageError(f"--device {args.device}: {problem}")
    generation = read_json_file(Path(args.config), "--config") if args.config else None
    sources = model_sources(args, need_vae, patterns)
    if sources is None:
        model_dir, vae_dir = tiny_default()
        generation = generation or TINY_GENERATION  # a 10 s song, so the default run takes seconds
    else:
        model_dir, vae_dir = sources
    backend = args.backend or default_backend(model_dir)
    try:
        generation = GenerationConfig.from_dict(generation)
    except ValueError as exc:
        raise UsageError(f"--config {args.config}: {exc}") from None
    return model_dir, vae_dir, generation, backend


def _pipeline(args, need_vae: bool = True):
    from ..pipeline import YuE2Pipeline

    model_dir, vae_dir, generation, backend = _models(args, need_vae)
    check_kv_flag(args, backend)
    engine_options = {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens")
                      if getattr(args, name, None) is not None}
    if getattr(args, "no_sliced_head", False):
        engine_options["sliced_head"] = False
    if getattr(args, "vllm_runner", "auto") != "auto":
        engine_options["runner"] = check_runner(args.vllm_runner, args.device, backend)
    if getattr(args, "engine_start_timeout", None) is not None:
        engine_options["start_timeout_s"] = args.engine_start_timeout
    if getattr(args, "concurrency", None) and "max_num_seqs" not in engine_options:
        engine_options["max_num_seqs"] = args.concurrency  # one engine row per song in flight
    pipe = YuE2Pipeline(model_dir, vae_dir, device=args.device, memory_budget_gib=args.budget, backend=backend,
                        generation_config=generation, verify_hashes=args.verify_hashes,
                        ar_checkpoint=args.ar_checkpoint, quantization=args.quantization, offload_ar=args.offload_ar,
                        dtype=args.dtype, engine_options=engine_options, start_engine=True, cfg_engine=args.cfg_engine,
                        quantized_policy=args.quantized_policy, reproducible=getattr(args, "reproducible", False),
                        torch_execution=getattr(args, "torch_execution", "auto"),
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    note = torch_ar_note(backend, pipe.device.type, vllm_installed())
    if note is not None:
        import logging

        logging.getLogger("yue2_vllm").warning("%s", note)
    return pipe


def check_kv_flag(args, backend: str, device_checks: bool = True) -> None:
    """--kv-cache-dtype refused naming the flag, before anything loads or is printed: against the backend, the AR
    checkpoint's kv_cache_scheme and (`device_checks`) this machine's device. A Ray head leaves the device to the
    replicas (their own pipelines check it there)."""
    from ..derive import OVERRIDE_ENV
    from ..kv_cache import option_problem

    form = getattr(args, "kv_cache_dtype", "auto")
    if not device_checks:
        problem = option_problem(form, backend=backend, cfg_engine=args.cfg_engine, flag="--kv-cache-dtype",
                                 checkpoint=args.ar_checkpoint or os.environ.get(OVERRIDE_ENV) or None)
        if problem:
            raise ValueError(problem)
        return
    from ..pipeline import check_kv_form, resolve_device

    check_kv_form(form, resolve_device(args.device), backend, args.cfg_engine, "--kv-cache-dtype",
                  reproducible=getattr(args, "reproducible", False), dtype=args.dtype, ar_checkpoint=args.ar_checkpoint)


def replica_admission(args, device_type: str) -> tuple:
    """What a server whose songs run on replicas needs of the model flags, the weights resolved once:
    `(SongRules, backend, rows)` — the rules it admits songs by (the pipeline's, without loading any weights), and
    the songs one replica serves at once when --max-concurrency is not given (the engine's rows as the memory split
    on a replica's `device_type` sizes them, as `doctor` shows; 1 on the torch backend)."""
    from ..hub import HEAD_PATTERNS
    from ..protocol import SongRules
    from ..tokenizer import YuE2Tokenizer

    model_dir, vae_dir, generation, backend = _models(args, patterns=HEAD_PATTERNS)  # the replicas load weights
    head_files(model_dir, vae_dir)
    rules = SongRules(generation, YuE2Tokenizer.from_model_dir(model_dir), getattr(args, "reproducible", False))
    if backend == "torch" or (backend == "auto" and not vllm_installed()):
        return rules, backend, 1
    rows = memory_plan(model_dir, vae_dir, device_type, args.budget, offload_ar=args.offload_ar,
                       generation=generation, weights=head_weights_bytes(model_dir, vae_dir, args),
                       kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto")).max_num_seqs
    return rules, backend, rows


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


def head_weights_bytes(model_dir, vae_dir, args) -> tuple[int, int]:
    """`(MoT bytes, VAE bytes)` for the memory split without the weights here (hub.weights_bytes_of)."""
    from ..hub import HubOptions, ModelSource, weights_bytes_of
    from ..checkpoint import weights_bytes

    hub = HubOptions(progress=not getattr(args, "quiet", False))

    def size(source) -> int:
        if source is None:
            return 0
        return weights_bytes_of(source, hub)[0] if isinstance(source, ModelSource) else weights_bytes(source)

    return size(model_dir), size(vae_dir)


def memory_plan(model_dir, vae_dir, device_type: str, budget_gib: float | None, *, max_num_seqs: int | None = None,
                offload_ar: bool = False, generation=None, weights: tuple[int, int] | None = None,
                kv_cache_dtype: str = "auto"):
    """The engine / torch split (memory.plan_memory) of these weights on `device_type`; with `generation`, rows
    sized for its songs (a prompt + the larger phase budget) instead of upstream's. On this machine's integrated
    GPU the split is one pool with the host (`budget_gib` None: the pool). `weights`: the (MoT, VAE) file bytes
    where the files are not here (a Ray head), else they are read from the directories; the VAE is planned by its
    config.json, the release's where the directory has none (so the rows never hang on it). `kv_cache_dtype`: the
    engine's KV form, counted by its element size."""
    from ..checkpoint import read_json, weights_bytes
    from ..kv_cache import element_bytes
    from ..memory import (PROMPT_ESTIMATE_TOKENS, ar_expert_bytes, default_budget_gib, device_pool, plan_memory,
                          total_memory_bytes, vae_decode_bytes)
    from ..model.modeling import YuE2Config
    from ..model.vae import VAEConfig, decoder_bytes
    from ..pipeline import VAE_HALO_FRAMES, default_vae_core_frames

    config = YuE2Config.load(Path(model_dir))
    typical = {} if generation is None else {
        "typical_tokens": PROMPT_ESTIMATE_TOKENS + max(generation.abc.max_tokens, generation.semantic.max_tokens)}
    pool = device_pool(device_type)
    import torch

    card = (total_memory_bytes(device_type) if device_type.startswith("cuda") and pool is None
            and torch.cuda.is_available() else None)
    budget_gib = budget_gib or default_budget_gib(pool, card)
    vae, tile = 0, 0
    if vae_dir is not None:  # the decoder we keep, by its config (the release's where none is here yet)
        config_file = Path(vae_dir) / "config.json"
        vae_config = VAEConfig.from_dict(read_json(config_file)) if config_file.is_file() else VAEConfig()
        vae = decoder_bytes(vae_config)
        tile = vae_decode_bytes(vae_config, default_vae_core_frames(budget_gib), VAE_HALO_FRAMES)
    return plan_memory(config, device=device_type, budget_gib=budget_gib, engine_weights=ar_expert_bytes(config),
                       torch_model=weights[0] if weights else weights_bytes(model_dir), vae=vae, vae_tile=tile,
                       max_num_seqs=max_num_seqs,
                       offload_ar=offload_ar, total=card_bytes(device_type, budget_gib), unified=pool,
                       kv_dtype_bytes=element_bytes(kv_cache_dtype), **typical)


def card_bytes(device_type: str, budget_gib: float) -> int | None:
    """A replica's device memory as far as this machine can tell: its own first GPU, or the budget when it has
    none (the head of a GPU cluster may have no GPU); None for host memory."""
    import torch

    if device_type != "cuda" or torch.cuda.is_available():
        return None
    return int(budget_gib * 2**30)


def check_runner(runner: str, device: str, backend: str) -> str:
    """`--vllm-runner`, refused before anything is written when this machine's vLLM cannot run it."""
    if backend != "torch":
        from ..devices import resolve_device
        from ..engine.backend import vllm_version
        from ..engine.runner import resolve_runner

        try:
            resolve_runner(runner, resolve_device(device).type, vllm_version())
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


def model_sources(args, need_vae: bool = True, patterns: tuple | None = None) -> tuple | None:
    """`--model` / `--vae` (and `--ar-checkpoint`) as model_names names them: local directories, or Hugging
    Face repo ids resolved to their cached snapshots (`--revision` / `--vae-revision`; download bars hidden by
    `--quiet`), each error naming its flag; None for the embedded tiny default."""
    from ..hub import HubOptions, is_local_name, resolve_model

    names = model_names(args, need_vae)
    if names is None:
        return None
    hub = HubOptions(progress=not getattr(args, "quiet", False))
    sources = []
    for flag, name, revision in (("--model", names[0], getattr(args, "revision", None)),
                                 ("--vae", names[1], getattr(args, "vae_revision", None))):
        if name is None:
            sources.append(None)
            continue
        if is_local_name(name) and not Path(name).expanduser().is_dir():
            raise UsageError(f"{flag} {name}: " + ("is not a directory" if Path(name).expanduser().exists()
                                                   else "does not exist"))
        sources.append(resolve_model(name, revision=revision, what=flag, hub=hub,
                                     **({"patterns": patterns} if patterns is not None else {})))
    checkpoint = getattr(args, "ar_checkpoint", None)
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise UsageError(f"--ar-checkpoint {checkpoint}: " + ("is not a directory" if Path(checkpoint).exists()
                                                             else "does not exist"))
    return sources[0], sources[1]


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
