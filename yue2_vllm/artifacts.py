"""Song artifacts on disk: stage checkpoints that a resumed run can trust, and the final manifest.

A run directory holds one `<stage>.stage.json` per finished stage, naming the identity of the
run and the sha256 of every file the stage wrote. A stage counts as done only if its record
exists, belongs to the same identity, and every file still hashes the same; otherwise it and
every later stage are redone. All files are written to a temp name and renamed into place.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from .checkpoint import json_bytes, read_json, sha256_file, write_bytes_atomic, write_json_atomic

STAGES = ("plan", "semantic", "synthesis", "audio")
STATE_FILE = "run_state.json"
RESULT_FILE = "result.json"
SCHEMA_VERSION = 1
SAMPLE_RATE = 48000


class ResumeError(RuntimeError):
    """A run directory cannot be resumed for this request (different request, config or weights)."""


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


def read_flac(path: Path) -> tuple[np.ndarray, int]:
    import soundfile

    audio, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    return audio, rate


class RunDirectory:
    """Stage checkpoints of one song under `path`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _record(self, stage: str) -> Path:
        return self.path / f"{stage}.stage.json"

    def _file(self, name: str) -> Path:
        path = self.path / name
        if path.is_symlink():
            raise ResumeError(f"{path}: refusing a symlink in a run directory")
        return path

    # -- run state

    def start(self, run_identity: str, request: dict, *, resume: bool) -> None:
        """Claim the directory for a run; a resumed run must have the same identity."""
        state_path = self._file(STATE_FILE)
        if state_path.exists():
            if not resume:
                raise FileExistsError(f"{self.path}: holds a run already; pass resume to continue it")
            state = read_json(state_path)
            if state.get("identity") != run_identity:
                raise ResumeError(f"{self.path}: was started for a different request, configuration or weights "
                                  f"(identity {str(state.get('identity'))[:12]}…, now {run_identity[:12]}…); "
                                  "use a new output directory")
            return
        if self.path.exists() and any(self.path.iterdir()) and not resume:
            raise FileExistsError(f"{self.path}: output directory is not empty")
        self.path.mkdir(parents=True, exist_ok=True)
        self.set_state(run_identity, request, "created")

    def set_state(self, run_identity: str, request: dict, state: str, **extra) -> None:
        write_json_atomic(self._file(STATE_FILE), {"schema_version": SCHEMA_VERSION, "identity": run_identity,
                                                   "state": state, "request": request, **extra})

    def state(self) -> dict | None:
        path = self._file(STATE_FILE)
        return read_json(path) if path.exists() else None

    # -- stages

    def write_stage(self, stage: str, run_identity: str, files: dict[str, bytes], meta: dict) -> None:
        for name, data in files.items():
            write_bytes_atomic(self._file(name), data)
        record = {"stage": stage, "identity": run_identity, "meta": meta,
                  "files": {name: {"sha256": sha256_file(self._file(name)), "bytes": len(data)}
                            for name, data in files.items()}}
        write_json_atomic(self._record(stage), record)

    def verified_stage(self, stage: str, run_identity: str) -> dict | None:
        """The stage's meta if its record and all its files verify, else None (redo it)."""
        record_path = self._record(stage)
        if not record_path.exists():
            return None
        try:
            record = read_json(record_path)
        except ValueError:
            return None
        if record.get("identity") != run_identity or record.get("stage") != stage:
            return None
        for name, entry in record.get("files", {}).items():
            path = self._file(name)
            if not path.is_file() or path.stat().st_size != entry.get("bytes") \
                    or sha256_file(path) != entry.get("sha256"):
                return None
        return record.get("meta", {})

    def discard_from(self, stage: str) -> None:
        """Forget `stage` and every later stage (their files are rewritten when redone)."""
        for later in STAGES[STAGES.index(stage):]:
            self._record(later).unlink(missing_ok=True)
        self._file(RESULT_FILE).unlink(missing_ok=True)

    # -- final result

    def write_result(self, result: dict) -> dict:
        """`result.json` with sha256 and size of every other file (the mutable run state aside)."""
        artifacts = {}
        for path in sorted(self.path.iterdir()):
            if path.name in (RESULT_FILE, STATE_FILE) or not path.is_file() or path.name.endswith(".tmp"):
                continue
            artifacts[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        document = {**result, "artifacts": artifacts}
        write_bytes_atomic(self._file(RESULT_FILE), json_bytes(document))
        return document

    def verified_result(self, run_identity: str) -> dict | None:
        path = self._file(RESULT_FILE)
        if not path.exists():
            return None
        document = read_json(path)
        if document.get("status") != "complete" or document.get("identity") != run_identity:
            return None
        for name, entry in document.get("artifacts", {}).items():
            file = self._file(name)
            if not file.is_file() or sha256_file(file) != entry.get("sha256"):
                return None
        return document


def verify_result(directory: str | os.PathLike, expected_identity: str | None = None) -> dict:
    """Check a finished song directory; raise naming the first file that does not verify."""
    directory = Path(directory)
    document = read_json(directory / RESULT_FILE)
    if document.get("status") != "complete":
        raise ValueError(f"{directory / RESULT_FILE}: status is {document.get('status')!r}, not 'complete'")
    if expected_identity is not None and document.get("identity") != expected_identity:
        raise ValueError(f"{directory / RESULT_FILE}: identity differs from the expected run")
    required = {"audio.flac", "prefix.npy", "semantic.npy", "latent.npy", "request.json", "config.json"}
    missing = sorted(required - set(document.get("artifacts", {})))
    if missing:
        raise ValueError(f"{directory / RESULT_FILE}: manifest lacks {missing}")
    for name, entry in document["artifacts"].items():
        path = directory / name
        if path.is_symlink() or not path.is_file():
            raise ValueError(f"{path}: missing or not a regular file")
        if path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: does not match the sha256 recorded in {RESULT_FILE}")
    return document
