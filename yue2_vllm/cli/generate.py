"""`yue2-vllm generate`: one song into a run directory (resumable), with per-stage progress bars.
"""
from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path

from .setup import EXPECTED_ERRORS, _signal_name, build_request, print_status, song_setup

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
                      timing=_summary(document))
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


def cmd_generate(args) -> int:
    request, overrides = build_request(args)
    options = take_options(args)
    if options.many:
        from ..request_json import UsageError
        from ..takes import check_takes_for

        try:
            check_takes_for(request, options, args.stage)
        except ValueError as exc:
            raise UsageError(f"--takes: {exc}") from None
        with song_setup(args).pipeline() as pipe:
            lines = run_takes_cli(pipe, request, overrides, Path(args.output) / request.id, options,
                                  resume=args.resume, stage=args.stage, quiet=args.quiet,
                                  scorer_command=args.scorer)
        for line in lines:
            print_status(line)
        failed = [line for line in lines[:-1] if line["status"] == "failed"]
        for line in failed:
            print(f"yue2-vllm: error: take {line['take']}: {line.get('reason')}", file=sys.stderr)
        return 1 if failed or lines[-1]["not_complete"] else 0
    with song_setup(args).pipeline() as pipe:
        status = run_song(pipe, request, overrides, Path(args.output) / request.id, resume=args.resume,
                          stage=args.stage, quiet=args.quiet)
    print_status(status)
    if status["status"] == "failed":
        print(f"yue2-vllm: error: {status['reason']}", file=sys.stderr)
        return 1
    return 0


def handle_status(handle, quiet: bool, cancel_reason: str = "cancelled") -> dict:
    if handle.state == "cancelled":
        return cancelled_status(handle.request, handle.directory, cancel_reason)
    return song_outcome(handle.request, handle.directory, document=handle.document, error=handle.error, quiet=quiet)
