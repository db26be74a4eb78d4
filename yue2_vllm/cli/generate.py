"""`yue2-vllm generate`: one song into a run directory (resumable), with per-stage progress bars.
"""
from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path

from ..song.progress import Progress, token_budgets
from .setup import EXPECTED_ERRORS, _signal_name, adapter_options, build_request, print_status, song_setup
from .transcribe import KNOB_FLAGS, report, summary_line, write_record


def _summary(document: dict) -> dict:
    timing = document.get("timing", {})
    phases = {phase: {k: timing[phase].get(k) for k in ("seconds", "output_tokens", "output_tps", "backend_actual")
                      if k in timing[phase]} for phase in ("abc", "semantic") if phase in timing}
    return {**phases, **{k: timing[k] for k in ("nar_seconds", "vae_seconds") if k in timing}}


def run_song(pipe, request, overrides: dict, directory: Path, *, resume: bool, stage: str, quiet: bool,
             parent=None) -> dict:
    """Generate one song into `directory` (with `parent`: continue that capped song); returns the status line
    (failure.json is written on error; a continuation its parent refuses raises, before anything is written)."""
    from ..song.continuation import ContinueRefused

    progress = Progress(not quiet, token_budgets(pipe.rules, request, overrides),
                        {"semantic": len(parent.tokens)} if parent is not None else None)
    try:
        document = pipe.generate_to(directory, request, resume=resume, stage=stage,
                                    abc_sampling=overrides.get("abc"), semantic_sampling=overrides.get("semantic"),
                                    on_token=progress.on_token, on_progress=progress.on_progress, parent=parent)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: recorded, then the whole command stops
        progress.close()
        exc.status = cancelled_status(request, directory, f"cancelled by {_signal_name(exc)}; rerun with --resume")
        raise
    except ContinueRefused:  # refused before anything was written: one line, exit 2
        progress.close()
        raise
    except Exception as exc:  # recorded per song; the caller decides whether to go on
        progress.close()
        return song_outcome(request, directory, error=exc, quiet=quiet)
    progress.close()
    return song_outcome(request, directory, document=document)


def cancelled_status(request, directory: Path, reason: str) -> dict:
    """The status line of a song stopped by Ctrl-C, SIGTERM or a cancel; its failure.json says the same."""
    from ..artifacts import RunDirectory

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
    from ..artifacts import ResumeError, RunDirectory, RunExistsError
    from ..checkpoint import disk_full

    run = RunDirectory(directory)
    if error is not None:
        reason = str(error)
        if isinstance(error, RunExistsError):
            reason = (f"{directory}: holds a run already; pass --resume to continue it, or choose another --output "
                      "or --id" if error.holds_run else f"{directory}: is not empty; choose another --output or --id")
        if disk_full(error):
            reason += "; free space and rerun with --resume"
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
                      **{key: document[key] for key in ("truncation", "continuation") if document.get(key)},
                      timing=_summary(document))
        if "continued_from" in document:
            status["continued_from"] = document["continued_from"]["directory"]
    return status


def take_options(args):
    """The generate flags' TakeOptions (a UsageError names the flag)."""
    from ..request_json import UsageError
    from ..takes import TakeOptions

    takes = getattr(args, "takes", 1) or 1
    for flag, name in (("--best-of", "best_of"), ("--takes-share-score", "takes_share_score"), ("--scorer", "scorer")):
        if takes == 1 and getattr(args, name, None):
            raise UsageError(f"{flag}: picks or shares among takes: give --takes >= 2")
    try:
        return TakeOptions(takes, bool(getattr(args, "best_of", False)), bool(getattr(args, "takes_share_score", False)))
    except ValueError as exc:
        flag = "--" + str(exc).split(":")[0].replace("_", "-")
        raise UsageError(f"{flag}: {exc}") from None


def run_takes_cli(pipe, request, overrides: dict, directory: Path, options, *, resume: bool, stage: str,
                  quiet: bool, scorer_command: str | None = None) -> list[dict]:
    """Every take at once through a song scheduler: a status line per take, then one for the takes."""
    from ..scheduler import generate_takes
    from ..takes import command_scorer

    scorer = command_scorer(scorer_command) if scorer_command else None
    handles = {}
    document = generate_takes(pipe, request, directory, options, overrides=overrides, resume=resume, stage=stage,
                              scorer=scorer, scorer_name=f"scorer: {scorer_command}" if scorer else None,
                              on_take=handles.__setitem__)
    statuses = []
    for record in document["results"]:
        handle = handles.get(record["take"])
        status = handle_status(handle, quiet) if handle is not None and handle.done else \
            {"status": record["status"], "id": record["id"], "directory": record["directory"],
             "reason": record.get("error")}
        status.update(take=record["take"], seed=record["seed"], signals=record["signals"],
                      **({"score": record.get("score")} if "score" in record else {}))
        statuses.append(status)
    summary = {"status": "takes", "id": request.id, "directory": str(directory), "takes": options.takes,
               "complete": document["complete"], "not_complete": document["not_complete"], "pick": document["pick"],
               "signal": document["signal"]}
    return statuses + [summary]


# What `generate --continue` takes from the song it continues, not from flags.
CONTINUE_TAKES_OWN = (("request", "--request"), ("style", "--style"), ("lyrics", "--lyrics"),
                      ("lyrics_file", "--lyrics-file"), ("abc_file", "--abc-file"), ("cot", "--cot"),
                      ("seed", "--seed"), ("cfg_scale", "--cfg-scale"), ("instrumental", "--instrumental"),
                      ("melody_audio", "--melody-audio"), *KNOB_FLAGS.items())


def continued_setup(setup, parent, child):
    """`setup` with the song's own generation config and adapters, read from its directory (ParentSong): what its
    continuation to `child` (its request) runs with. An adapter --lora / --lora-modules registers under the same
    name is registered from the flag (the run refuses one whose contents differ from the song's: continuation.
    check_adapters)."""
    from dataclasses import replace

    modules = dict(setup.adapters.modules)
    for name, source in parent.adapter_sources():
        modules.setdefault(name, source)
    instrumental = parent.instrumental_adapter()
    adapters = replace(setup.adapters, modules=tuple(modules.items()),
                       instrumental=instrumental if instrumental in modules else None)
    return replace(setup, generation=parent.generation_config(child), adapters=adapters)


def check_continue_flags(args, setup, parent) -> None:
    """The flags whose settings a continuation takes from the song instead, refused (naming the flag) where they
    would change it: a --config whose NAR settings differ from the song's (its sampling is the song's anyway), a
    --lora the song was not made with, another --instrumental-adapter. (The request's flags: CONTINUE_TAKES_OWN.)"""
    from ..request_json import UsageError
    from ..song.continuation import SHARED_GENERATION

    if args.config:
        had, given = parent.config.get("generation") or {}, setup.generation.to_dict()
        for key in SHARED_GENERATION:
            if key in had and had[key] != given[key]:
                raise UsageError(f"--config {args.config}: the song was made with {key} {had[key]!r}, --config gives "
                                 f"{given[key]!r}; --continue goes on with the song's own generation config (its "
                                 "config.json): leave --config out")
    own = [(ref.name, ref.scale) for ref in parent.request.adapters]
    for name, scale in setup.song_adapters:
        if (name, scale) not in own:
            made = ", ".join(f"{n} at {s:g}" for n, s in own) or "none"
            raise UsageError(f"--lora: {name} at {scale:g} is not an adapter the song was made with ({made}); "
                             "--continue goes on with the song's own adapters: leave --lora out")
    chosen = getattr(args, "instrumental_adapter", None)
    if chosen is not None and chosen != parent.instrumental_adapter():
        raise UsageError(f"--instrumental-adapter {chosen}: the song was made with "
                         f"{parent.instrumental_adapter() or 'none'}; --continue goes on with the song's own "
                         "adapters: leave --instrumental-adapter out")


def cmd_continue(args) -> int:
    """`generate --continue RUN_DIR --seconds N`: the capped song in RUN_DIR continued to N seconds, with its own
    request, generation config and adapters (read from RUN_DIR)."""
    from ..request_json import UsageError
    from ..song.continuation import read_parent

    if args.seconds is None:
        raise UsageError("--continue: give --seconds, the longer length to continue the song to")
    for name, flag in CONTINUE_TAKES_OWN:
        if getattr(args, name, None) not in (None, False):
            raise UsageError(f"{flag}: --continue goes on with the song's own request; leave {flag} out")
    if args.stage != "audio" or args.takes != 1:
        raise UsageError("--continue: makes one whole song; leave out --stage plan and --takes")
    parent = read_parent(args.continue_from)  # one line and exit 2 when it cannot continue: nothing is loaded
    try:
        request = parent.child_request(args.seconds, args.id)
    except ValueError as exc:  # a bad --seconds or --id, named
        message = str(exc).removeprefix("seconds: ")
        flag = "--id" if "SongRequest.id" in message else "--seconds"
        raise UsageError(f"{flag}: {message}") from None
    setup = song_setup(args)
    check_continue_flags(args, setup, parent)
    with continued_setup(setup, parent, request).pipeline() as pipe:
        status = run_song(pipe, request, parent.overrides(), Path(args.output) / request.id, resume=args.resume,
                          stage="audio", quiet=args.quiet, parent=parent)
    print_status(status)
    if status["status"] == "failed":
        print(f"yue2-vllm: error: {status['reason']}", file=sys.stderr)
        return 1
    return 0


def cmd_generate(args) -> int:
    if getattr(args, "continue_from", None):
        return cmd_continue(args)
    adapters = adapter_options(args)  # --lora parsed once: the songs' adapters and the pipeline's
    request, overrides, transcription = build_request(args, adapters[1])
    if transcription is not None:  # a cover: its warnings and licence before the model loads
        report(transcription)
    options = take_options(args)
    directory = Path(args.output) / request.id
    if options.many:
        from ..request_json import UsageError
        from ..takes import check_takes_for

        try:
            check_takes_for(request, options, args.stage)
        except ValueError as exc:
            raise UsageError(f"--takes: {exc}") from None
        with song_setup(args, adapters=adapters).pipeline() as pipe:
            lines = run_takes_cli(pipe, request, overrides, directory, options,
                                  resume=args.resume, stage=args.stage, quiet=args.quiet,
                                  scorer_command=args.scorer)
        if transcription is not None and lines[-1]["complete"]:
            write_record(directory, transcription)
            lines[-1]["transcription"] = summary_line(transcription)
        for line in lines:
            print_status(line)
        failed = [line for line in lines[:-1] if line["status"] == "failed"]
        for line in failed:
            print(f"yue2-vllm: error: take {line['take']}: {line.get('reason')}", file=sys.stderr)
        return 1 if failed or lines[-1]["not_complete"] else 0
    with song_setup(args, adapters=adapters).pipeline() as pipe:
        status = run_song(pipe, request, overrides, directory, resume=args.resume,
                          stage=args.stage, quiet=args.quiet)
    if transcription is not None and status["status"] in ("complete", "planned"):
        write_record(directory, transcription)
        status["transcription"] = summary_line(transcription)
    print_status(status)
    if status["status"] == "failed":
        print(f"yue2-vllm: error: {status['reason']}", file=sys.stderr)
        return 1
    return 0


def handle_status(handle, quiet: bool, cancel_reason: str = "cancelled") -> dict:
    if handle.state == "cancelled":
        return cancelled_status(handle.request, handle.directory, cancel_reason)
    return song_outcome(handle.request, handle.directory, document=handle.document, error=handle.error, quiet=quiet)
