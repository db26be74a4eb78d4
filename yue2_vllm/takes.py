"""Takes: several whole songs from one request, run as concurrent songs over one scheduler.

Take k is the one-take song of the same request with seed `take_seed(seed, k)` (take 1: the request's own seed,
so take 1 is exactly today's song, in the directory a one-take run uses). The takes run as separate engine rows at
once, so the prompt they share (the text, and the score when they share one) is prefilled once and taken from
vLLM's prefix cache by the others. Each take keeps its own run directory (`<dir>` for take 1,
`<dir>/takes/<k>` for the others), with its own stages, result and resume; a take that fails fails alone.
`takes.json` in the job's directory lists every take: status, seed, directory, signals and the pick.

The signal is the model's own likelihood: the mean raw log-prob it gave its sampled semantic (and ABC) tokens,
not a quality score. A scorer (a callable here, `--scorer CMD` on the CLI) may replace it for the pick.
"""
from __future__ import annotations

import logging
import os
import shlex
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from .artifacts import TAKES_DIR, TAKES_FILE
from .checkpoint import write_json_atomic
from .protocol import MAX_SEED, SongRequest, _is_int

LOG = logging.getLogger(__name__)
MAX_TAKES = 8
TAKE_FIELDS = ("takes", "best_of", "takes_share_score")
Scorer = Callable[[dict], "float | None"]  # a take's record (its `directory` holds audio.flac) -> score


def take_seed(seed: int, take: int) -> int:
    """Take k's seed: `(seed + k - 1) mod 2**63` (take 1 is the request's seed; take k of seed s is the one-take
    song of seed s + k - 1)."""
    if not _is_int(take) or take < 1:
        raise ValueError(f"take must be an integer >= 1, got {take!r}")
    return (int(seed) + take - 1) % MAX_SEED


def take_id(song_id: str, take: int) -> str:
    """Take 1 keeps the song's id; take k is `<id>.t<k>` (ids stay within the 180-character limit)."""
    return song_id if take == 1 else f"{song_id[:176]}.t{take}"


def take_directory(root: str | os.PathLike, take: int) -> Path:
    return Path(root) if take == 1 else Path(root) / TAKES_DIR / str(take)


@dataclass(frozen=True)
class TakeOptions:
    """How many takes, whether to mark the best as the pick (`best_of`), and whether they share one planned score."""

    takes: int = 1
    best_of: bool = False
    share_score: bool = False

    def __post_init__(self):
        check_take_options(self.takes, self.best_of, self.share_score)

    @property
    def many(self) -> bool:
        return self.takes > 1

    def to_dict(self) -> dict:
        return {"takes": self.takes, "best_of": self.best_of, "takes_share_score": self.share_score}


def check_take_options(takes, best_of, share_score, limit: int = MAX_TAKES) -> None:
    """ValueErrors that begin with the field they are about (`takes:`, `best_of:`, `takes_share_score:`)."""
    if not _is_int(takes) or not 1 <= takes <= limit:
        raise ValueError(f"takes: must be an integer in [1, {limit}], got {takes!r}")
    for name, value in (("best_of", best_of), ("takes_share_score", share_score)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}: must be true or false, got {value!r}")
        if value and takes == 1:
            raise ValueError(f"{name}: needs takes >= 2 (it picks among or shares between takes)")


def pop_take_options(data: dict, limit: int = MAX_TAKES) -> TakeOptions:
    """Take the take fields out of a request document (a POST body, a batch row, a request file)."""
    takes = data.pop("takes", 1)
    best_of, share = data.pop("best_of", False), data.pop("takes_share_score", False)
    if isinstance(takes, float) and takes.is_integer():
        takes = int(takes)
    check_take_options(takes, best_of, share, limit)
    return TakeOptions(takes, best_of, share)


def check_takes_for(request: SongRequest, options: TakeOptions, stage: str) -> None:
    """Refuse takes that have nothing to vary: a `stage: plan` job whose score is given (or that has none)."""
    if options.many and stage == "plan" and (request.abc is not None or request.cot == "off"):
        raise ValueError("takes: a stage 'plan' job with " + ("an external score" if request.abc is not None
                                                             else "cot 'off'") + " has nothing to plan; send takes: 1")


def take_request(request: SongRequest, take: int, abc: str | None = None) -> SongRequest:
    """Take k's request: the request with take k's seed and id (and the shared score, when given)."""
    changes = {"seed": take_seed(request.seed, take), "id": take_id(request.id, take)}
    if abc is not None:
        changes["abc"] = abc
    return replace(request, **changes)


def shares_plan(request: SongRequest, options: TakeOptions) -> bool:
    """Whether takes 2..N render take 1's planned score (there is a score to plan, and the request asks)."""
    return options.share_score and request.abc is None and request.cot != "off"


# --------------------------------------------------------------------------- signals and the pick


def take_signals(document: dict | None) -> dict:
    """A finished take's signals from its result.json timing: the model's mean log-prob per phase and the prompt
    tokens its engine took from the prefix cache."""
    timing = (document or {}).get("timing") or {}
    signals = {}
    for phase in ("abc", "semantic"):
        record = timing.get(phase) or {}
        signals[f"{phase}_mean_logprob"] = record.get("mean_logprob")
        signals[f"{phase}_prompt_tokens"] = record.get("prompt_tokens")
        signals[f"{phase}_cached_prompt_tokens"] = record.get("cached_prompt_tokens")
    return signals


def pick_take(records: Sequence[dict]) -> int | None:
    """The take with the highest score where a scorer ran (a take it could not score is not picked), else the
    highest semantic mean log-prob; ties: the lower k."""
    scored = any("score" in record for record in records)
    best, best_value = None, None
    for record in records:
        if record.get("status") != "complete":
            continue
        value = record.get("score") if scored else (record.get("signals") or {}).get("semantic_mean_logprob")
        if value is None:
            continue
        if best_value is None or value > best_value:
            best, best_value = record["take"], value
    return best


def command_scorer(command: str, timeout: float = 600.0) -> Scorer:
    """A scorer that runs `command <take directory>` and reads one number from its stdout (higher is better)."""
    argv = shlex.split(command)
    if not argv:
        raise ValueError("--scorer: an empty command")

    def score(record: dict) -> float:
        done = subprocess.run([*argv, str(record["directory"])], capture_output=True, text=True, encoding="utf-8",
                              errors="replace", timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"--scorer {command!r} exited {done.returncode} for take {record['take']}: "
                               f"{done.stderr.strip()[-500:]}")
        try:
            return float(done.stdout.strip().split()[-1])
        except (ValueError, IndexError):
            raise RuntimeError(f"--scorer {command!r} printed no number for take {record['take']}: "
                               f"{done.stdout.strip()[-200:]!r}") from None

    return score


def apply_scorer(records: list[dict], scorer: Scorer | None) -> None:
    """Each complete take's `score` (a scorer that raises leaves that take unscored, with the reason)."""
    if scorer is None:
        return
    for record in records:
        if record.get("status") != "complete":
            continue
        try:
            value = scorer(dict(record))
            record["score"] = None if value is None else float(value)
        except Exception as exc:
            record["score"], record["score_error"] = None, f"{type(exc).__name__}: {exc}"


def takes_document(request: SongRequest, options: TakeOptions, records: list[dict], *,
                   scorer_name: str | None = None, kept: int | None = None) -> dict:
    """takes.json: every take, which completed and which did not, and (best_of) the pick."""
    complete = [r["take"] for r in records if r.get("status") == "complete"]
    document = {"takes": options.takes, "seed": request.seed, "seed_rule": "take k: (seed + k - 1) mod 2**63",
                "share_score": shares_plan(request, options), "best_of": options.best_of,
                "complete": complete, "not_complete": [r["take"] for r in records if r["take"] not in complete],
                "signal": scorer_name or "semantic_mean_logprob", "pick": None, "kept": kept,
                "results": records}
    if options.best_of:
        document["pick"] = pick_take(records)
    return document


# --------------------------------------------------------------------------- running takes over a scheduler


def take_record(take: int, request: SongRequest, directory: Path, state: str, document: dict | None,
                error: BaseException | str | None) -> dict:
    record = {"take": take, "id": request.id, "seed": request.seed, "directory": str(directory),
              "status": state, "signals": take_signals(document) if state == "complete" else {}}
    if error is not None:
        record["error"] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return record


def read_score(directory: Path) -> str:
    """Take 1's planned score text (what the other takes render when they share it)."""
    path = Path(directory) / "score.abc"
    return path.read_text(encoding="utf-8")


def wait_prefilled(handle, poll: float = 0.02) -> None:
    """Until take 1 has its first AR token (its prompt is then in the engine's prefix cache) or has ended: takes
    scheduled in the same engine step as take 1 would prefill the shared prompt again, not find it cached."""
    while not handle.done and not any(handle.tokens.values()):
        handle.wait(poll)


def run_takes(scheduler, request: SongRequest, directory: str | os.PathLike, options: TakeOptions, *,
              overrides: dict | None = None, resume: bool = False, stage: str = "audio",
              scorer: Scorer | None = None, scorer_name: str | None = None,
              on_take: Callable[[int, object], None] | None = None) -> dict:
    """Run every take of `request` through `scheduler` (a `SongScheduler`), at once; returns (and writes) takes.json.

    Takes 2..N are submitted once take 1 has its first token (`wait_prefilled`); with a shared score, once take 1
    has planned it (they render it as an external score, so their semantic prompts are one prefix).
    `on_take(k, handle)` sees each take's handle when it is submitted."""
    check_takes_for(request, options, stage)
    root = Path(directory)
    requests = {k: take_request(request, k) for k in range(1, options.takes + 1)}
    handles: dict[int, object] = {}

    def submit(k: int, take: SongRequest, take_stage: str, take_resume: bool):
        handle = scheduler.submit(take, take_directory(root, k), overrides=overrides, resume=take_resume,
                                  stage=take_stage, group=request.id)
        handles[k] = handle
        if on_take is not None:
            on_take(k, handle)
        return handle

    records: dict[int, dict] = {}
    if shares_plan(request, options) and stage == "audio":
        first = submit(1, requests[1], "plan", resume)
        first.wait()
        if first.state != "complete":
            for k, take in requests.items():  # nothing to render without the score
                records[k] = take_record(k, take, take_directory(root, k), first.state if k == 1 else "failed",
                                         None, first.error if k == 1 else "take 1's score was not planned")
            return _write(root, request, options, [records[k] for k in sorted(records)], scorer, scorer_name)
        score = read_score(take_directory(root, 1))
        requests = {k: (take if k == 1 else take_request(request, k, abc=score)) for k, take in requests.items()}
        submit(1, requests[1], stage, True)
        for k in range(2, options.takes + 1):
            submit(k, requests[k], stage, resume)
    else:
        wait_prefilled(submit(1, requests[1], stage, resume))
        for k in range(2, options.takes + 1):
            submit(k, requests[k], stage, resume)
    for handle in scheduler.as_completed(list(handles.values())):
        k = next(k for k, h in handles.items() if h is handle)
        records[k] = take_record(k, requests[k], take_directory(root, k), handle.state, handle.document, handle.error)
    return _write(root, request, options, [records[k] for k in sorted(records)], scorer, scorer_name)


def _write(root: Path, request: SongRequest, options: TakeOptions, records: list[dict], scorer: Scorer | None,
           scorer_name: str | None) -> dict:
    apply_scorer(records, scorer)
    document = takes_document(request, options, records, scorer_name=scorer_name if scorer else None)
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / TAKES_FILE, document)
    return document

