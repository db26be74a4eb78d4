"""Song artifacts on disk: stage checkpoints that a resumed run can trust, and the final manifest.

A run directory holds one `<stage>.stage.json` per finished stage, naming the identity of the
run and the sha256 of every file the stage wrote. A stage counts as done only if its record
exists, belongs to the same identity, and every file still hashes the same; otherwise it and
every later stage are redone. All files are written to a temp name and renamed into place.
"""
from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from .checkpoint import fsync_directory, json_bytes, read_json, sha256_file, write_bytes_atomic, write_json_atomic

STAGES = ("plan", "semantic", "synthesis", "audio")
STATE_FILE = "run_state.json"
RESULT_FILE = "result.json"
FAILURE_FILE = "failure.json"  # why the last attempt failed; it goes once a run completes, so never an artifact
TAKES_DIR, TAKES_FILE = "takes", "takes.json"  # a job's takes 2..N (takes/<k>) and their listing

SCHEMA_VERSION = 1
SAMPLE_RATE = 48000
LOG = logging.getLogger(__name__)
# Per run state, the stages it claims are done (each must have its stage record behind it).
CLAIMED_STAGES = {"created": (), "planned": STAGES[:1], "semantic_generated": STAGES[:2], "synthesized": STAGES[:3],
                  "complete": STAGES, "plan_failed": (), "semantic_failed": STAGES[:1],
                  "synthesis_failed": STAGES[:2], "decode_failed": STAGES[:3], "cancelled": ()}
# The state a run is in just before a stage runs (what it may still claim while that stage is redone).
STATE_BEFORE = {"plan": "created", "semantic": "planned", "synthesis": "semantic_generated", "audio": "synthesized"}


class ResumeError(RuntimeError):
    """A run directory cannot be resumed for this request (different request, config or weights)."""


class RunExistsError(FileExistsError):
    """The output directory holds a run (`holds_run`) or other files, and resuming was not asked for."""

    def __init__(self, message: str, holds_run: bool):
        super().__init__(message)
        self.holds_run = holds_run


def npy_bytes(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=False)
    return buffer.getvalue()


def load_npy(path: Path) -> np.ndarray:
    return np.load(path, allow_pickle=False)


def flac_bytes(audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """`[samples, 2]` float audio in [-1, 1] as 24-bit FLAC."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, audio, sample_rate, format="FLAC", subtype="PCM_24")
    return buffer.getvalue()


REQUIRED_ARTIFACTS = frozenset({"audio.flac", "prefix.npy", "semantic.npy", "latent.npy", "request.json",
                                "config.json"})


def _read_record(path: Path) -> dict | None:
    """A JSON object of the run directory, or None when it is absent, a symlink, unreadable or not an object."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        value = read_json(path)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_stage_record(directory: Path, stage: str) -> dict | None:
    """A stage's record (`<stage>.stage.json`: its identity, meta and files), None when unreadable; its files are
    not checked here (`verify_result` checks a finished song's)."""
    record = _read_record(Path(directory) / f"{stage}.stage.json")
    if record is None or not isinstance(record.get("meta"), dict) or not isinstance(record.get("files"), dict):
        return None
    return record


def _files_verify(directory: Path, entries, required) -> bool:
    """Every required name is listed, and every listed file is a regular file with the recorded size and sha256."""
    if not isinstance(entries, dict) or not set(required) <= set(entries):
        return False
    for name, entry in entries.items():
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name \
                or not isinstance(entry, dict):
            return False
        path = directory / name
        if path.is_symlink() or not path.is_file() or path.stat().st_size != entry.get("bytes") \
                or sha256_file(path) != entry.get("sha256"):
            return False
    return True


class RunDirectory:
    """Stage checkpoints of one song under `path`.

    Anything on disk that does not verify (a missing, malformed or tampered record, a stage
    claimed complete without file hashes, a symlink) only means that stage is redone; the one
    refusal is a run recorded for a different identity.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _record(self, stage: str) -> Path:
        return self.path / f"{stage}.stage.json"

    # -- run state

    def start(self, run_identity: str, request: dict, *, resume: bool) -> bool:
        """Claim the directory for a run; a resumed run must have the same identity.

        Returns whether an earlier run is continued (False for a fresh directory)."""
        state_path = self.path / STATE_FILE
        if state_path.exists() or state_path.is_symlink():
            if not resume:
                raise RunExistsError(f"{self.path}: holds a run already; pass resume=True to continue it", True)
            self.remove_stale_temporaries()
            state = _read_record(state_path)
            recorded = state.get("identity") if state is not None else None
            problem = self.manifest_problem(state) if recorded is not None else None
            if recorded is None:  # unreadable state: each stage's own record decides what is reused
                self.set_state(run_identity, request, "created")
            elif problem is not None:  # as upstream: the manifest is dropped and every stage redone
                LOG.warning("%s: %s is inconsistent (%s); discarding it and redoing every stage", self.path,
                            STATE_FILE, problem)
                self.discard_from(STAGES[0])
                self.set_state(run_identity, request, "created")
                return False
            elif recorded != run_identity:
                raise ResumeError(f"{self.path}: was started for a different request, configuration or weights "
                                  f"(identity {str(recorded)[:12]}…, now {run_identity[:12]}…); "
                                  "use a new output directory")
            return True
        if self.path.exists() and any(p.name not in (FAILURE_FILE, TAKES_DIR, TAKES_FILE) for p in self.path.iterdir()) \
                and not resume:  # a job's other takes (takes/<k>) may have started first
            raise RunExistsError(f"{self.path}: output directory is not empty", False)
        self.path.mkdir(parents=True, exist_ok=True)
        self.set_state(run_identity, request, "created")
        return False

    def remove_stale_temporaries(self) -> list[str]:
        """Delete `*.tmp` files a killed writer left behind (every write goes to a temp name first); their names."""
        removed = []
        for path in self.path.glob("*.tmp"):
            if path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)
                removed.append(path.name)
        if removed:
            LOG.info("%s: removed %d stale temporary file(s) of an interrupted write", self.path, len(removed))
        return removed

    def manifest_problem(self, state: dict) -> str | None:
        """Why a readable run state cannot be trusted (an unknown state or schema, or a stage it claims
        without a stage record of its run behind it), or None."""
        name = state.get("state")
        if state.get("schema_version") != SCHEMA_VERSION:
            return f"schema_version {state.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        if not isinstance(name, str) or name not in CLAIMED_STAGES:
            return f"unknown state {name!r}"
        for stage in CLAIMED_STAGES[name]:
            record = _read_record(self._record(stage))
            # The audio stage belongs to the song's identity (its VAE included), the others to the run state's.
            if record is None or record.get("stage") != stage or \
                    (stage != "audio" and record.get("identity") != state.get("identity")):
                return f"state {name!r} claims the {stage} stage, which has no record of this run"
        return None

    def stop_claiming(self, stage: str, run_identity: str, request: dict) -> None:
        """Before `stage` is redone: a run state that claims it goes back to the state before it, so the
        manifest never names a stage record that is gone (a kill while the stage is redone leaves it consistent)."""
        name = (self.state() or {}).get("state")
        if isinstance(name, str) and stage in CLAIMED_STAGES.get(name, ()):
            self.set_state(run_identity, request, STATE_BEFORE[stage])

    def set_state(self, run_identity: str, request: dict, state: str, **extra) -> None:
        write_json_atomic(self.path / STATE_FILE, {"schema_version": SCHEMA_VERSION, "identity": run_identity,
                                                   "state": state, "request": request, **extra})

    def state(self) -> dict | None:
        return _read_record(self.path / STATE_FILE)

    # -- stages

    def write_stage(self, stage: str, run_identity: str, files: dict[str, bytes], meta: dict) -> None:
        for name, data in files.items():
            write_bytes_atomic(self.path / name, data)
        record = {"stage": stage, "identity": run_identity, "meta": meta,
                  "files": {name: {"sha256": sha256_file(self.path / name), "bytes": len(data)}
                            for name, data in files.items()}}
        write_json_atomic(self._record(stage), record)
        fsync_directory(self.path)  # the stage has landed once its files and record survive a power cut

    def verified_stage(self, stage: str, run_identity: str, files: Iterable[str] = (),
                       meta: Iterable[str] = ()) -> dict | None:
        """The stage's meta if its record belongs to this run, lists at least `files` (with hashes)
        and the `meta` keys, and every file it lists verifies; else None (redo the stage)."""
        record = _read_record(self._record(stage))
        if record is None or record.get("identity") != run_identity or record.get("stage") != stage:
            return None
        recorded_meta = record.get("meta")
        if not isinstance(recorded_meta, dict) or not set(meta) <= set(recorded_meta):
            return None
        return recorded_meta if _files_verify(self.path, record.get("files"), files) else None

    def discard_from(self, stage: str) -> None:
        """Forget `stage` and every later stage (their files are rewritten when redone)."""
        for later in STAGES[STAGES.index(stage):]:
            self._record(later).unlink(missing_ok=True)
        (self.path / RESULT_FILE).unlink(missing_ok=True)

    # -- failure record

    def write_failure(self, document: dict) -> None:
        write_json_atomic(self.path / FAILURE_FILE, document)

    def clear_failure(self) -> None:
        (self.path / FAILURE_FILE).unlink(missing_ok=True)

    # -- final result

    def write_result(self, result: dict) -> dict:
        """`result.json` with sha256 and size of every other file (the mutable run state and the
        failure record aside)."""
        artifacts = {}
        for path in sorted(self.path.iterdir()):
            if path.name in (RESULT_FILE, STATE_FILE, FAILURE_FILE, TAKES_FILE) or path.is_symlink() or not path.is_file() \
                    or path.name.endswith(".tmp"):
                continue
            artifacts[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        document = {**result, "artifacts": artifacts}
        write_bytes_atomic(self.path / RESULT_FILE, json_bytes(document))
        fsync_directory(self.path)
        return document

    def reuse_result(self, document: dict, stages: Iterable[str] = STAGES) -> dict:
        """A verified finished result, returned again untouched: it now says it was resumed (upstream's
        meaning) and that every stage was reused."""
        stages = list(stages)
        if document.get("resumed") is not True or document.get("stages_reused") != stages:
            document = {**document, "resumed": True, "stages_reused": stages}
            write_bytes_atomic(self.path / RESULT_FILE, json_bytes(document))
        fsync_directory(self.path)
        return document

    def verified_result(self, run_identity: str) -> dict | None:
        document = _read_record(self.path / RESULT_FILE)
        if document is None or document.get("status") != "complete" or document.get("identity") != run_identity:
            return None
        return document if _files_verify(self.path, document.get("artifacts"), REQUIRED_ARTIFACTS) else None


def verify_result(directory: str | os.PathLike, expected_identity: str | None = None) -> dict:
    """Check a finished song directory; raise naming the first file that does not verify."""
    directory = Path(directory)
    document = read_json(directory / RESULT_FILE)
    if document.get("status") != "complete":
        raise ValueError(f"{directory / RESULT_FILE}: status is {document.get('status')!r}, not 'complete'")
    if expected_identity is not None and document.get("identity") != expected_identity:
        raise ValueError(f"{directory / RESULT_FILE}: identity differs from the expected run")
    missing = sorted(REQUIRED_ARTIFACTS - set(document.get("artifacts", {})))
    if missing:
        raise ValueError(f"{directory / RESULT_FILE}: manifest lacks {missing}")
    for name, entry in document["artifacts"].items():
        path = directory / name
        if path.is_symlink() or not path.is_file():
            raise ValueError(f"{path}: missing or not a regular file")
        if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: does not match the sha256 recorded in {RESULT_FILE}")
    return document
