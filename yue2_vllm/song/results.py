"""What each stage hands the next: the plan (ABC score and semantic prompt), the semantic tokens, the finished song;
and the callbacks stages report through."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..instrumental import InstrumentalSteps
from ..protocol import CODEC_SIZE, SongRequest, check_token_ids

if TYPE_CHECKING:
    from .adapters import AdapterRequest

SAMPLE_RATE = 48000
PLAN_FILES = ("plan.json", "abc_tokens.npy", "prefix.npy", "score.abc")  # what SymbolicPlan.save writes
PLAN_REQUIRED = frozenset(PLAN_FILES[:3])
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
    instrumental: "InstrumentalSteps | None" = None  # an instrumental song's steps of the recipe
    adapters: "AdapterRequest | None" = None  # the song's adapters, resolved once (song.adapters); None: not yet

    def save(self, directory: str | os.PathLike) -> None:
        """Upstream's plan files in `directory`: `score.abc` (when there is a score), `abc_tokens.npy` and
        `prefix.npy` (int32), `plan.json` (request, timing, truncated, prefix, abc_ids, abc) and
        `plan_manifest.json` (each of those files' sha256)."""
        from ..artifacts import npy_bytes
        from ..checkpoint import json_bytes, sha256_file, write_bytes_atomic

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files = {"plan.json": json_bytes({"request": self.request.to_dict(), "timing": self.timing,
                                          "truncated": self.truncated, "prefix": list(self.prefix),
                                          "abc_ids": list(self.abc_ids), "abc": self.abc}),
                 "abc_tokens.npy": npy_bytes(np.asarray(self.abc_ids, np.int32)),
                 "prefix.npy": npy_bytes(np.asarray(self.prefix, np.int32)),
                 **({"score.abc": self.abc.encode("utf-8")} if self.abc is not None else {})}
        for name, data in files.items():
            write_bytes_atomic(directory / name, data)
        write_bytes_atomic(directory / "plan_manifest.json",
                           json_bytes({name: sha256_file(directory / name) for name in files}))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "SymbolicPlan":
        """Upstream's: the plan `save` wrote to `directory`, its exact ids restored (the score is never tokenized
        again), once every file verifies against `plan_manifest.json` (only the plan's files, no symlinks, each
        sha256, the arrays equal to plan.json's lists, score.abc its `abc`). Anything else is a ValueError of one
        line naming the file; an edited score is a new request's `abc`, not a changed plan."""
        from ..checkpoint import read_json, sha256_file

        directory = Path(directory)
        manifest_path = directory / "plan_manifest.json"
        try:
            manifest = read_json(manifest_path)
            if not isinstance(manifest, dict) or not PLAN_REQUIRED <= set(manifest):
                raise ValueError(f"{manifest_path}: lists no complete plan (needs {', '.join(sorted(PLAN_REQUIRED))})")
            for name, digest in manifest.items():
                path = directory / name
                if name not in PLAN_FILES or path.is_symlink():
                    raise ValueError(f"{path}: not a plan file" + (" (a symlink)" if name in PLAN_FILES else ""))
                if sha256_file(path) != digest:
                    raise ValueError(f"{path}: changed since the plan was saved; give an edited score as a new "
                                     "request's abc")
            data = read_json(directory / "plan.json")
            for key, name in (("abc_ids", "abc_tokens.npy"), ("prefix", "prefix.npy")):
                try:
                    array = np.load(directory / name, allow_pickle=False)
                except ValueError as exc:
                    raise ValueError(f"{directory / name}: not an array file ({exc})") from None
                if array.ndim != 1 or array.dtype.kind not in "iu" or array.tolist() != data[key]:
                    raise ValueError(f"{directory / name}: does not hold plan.json's {key}")
            if data["abc"] is not None and ("score.abc" not in manifest or
                                            (directory / "score.abc").read_bytes() != data["abc"].encode("utf-8")):
                raise ValueError(f"{directory / 'score.abc'}: does not hold plan.json's abc")
            try:
                request = SongRequest.from_dict(data["request"])
            except ValueError as exc:
                raise ValueError(f"{directory / 'plan.json'}: its request: {exc}") from None
            return cls(request, data["abc"], data["abc_ids"], data["prefix"], data["timing"], data["truncated"])
        except OSError as exc:
            raise ValueError(f"{directory}: cannot read the saved plan ({exc})") from None
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{directory / 'plan.json'}: not a saved plan ({type(exc).__name__}: {exc})") from None


@dataclass
class SemanticResult:
    plan: SymbolicPlan
    tokens: list[int]  # codec indices 0..32767 (token id − CODEC_OFFSET)
    timing: dict = field(default_factory=dict)
    truncated: bool = False
    synthesis: dict = field(default_factory=dict)  # the NAR's record: prefill weights, room admitted/waited
    rng_state: bytes | None = None  # the torch backend's generator after the last token (a continuation's)


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
    def abc(self) -> str | None:
        """The song's score (upstream's name; `plan.abc`)."""
        return self.plan.abc

    @property
    def request_identity(self) -> str:
        """Upstream's name of `identity`."""
        return self.identity

    @property
    def truncated(self) -> dict:
        return {"abc": self.plan.truncated, "semantic": self.semantic.truncated}

    @property
    def truncation(self) -> dict:
        """Why each cut phase stopped (see `truncation_record`)."""
        return truncation_record(self.request.seconds, self.truncated, self.config["generation"])

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / self.sample_rate

    def save(self, path: str | os.PathLike) -> str:
        """The audio as upstream writes it: `.flac` (24-bit) or `.wav` (float); returns the path."""
        import soundfile

        path = Path(path)
        subtype = {".flac": "PCM_24", ".wav": "FLOAT"}.get(path.suffix.lower())
        if subtype is None:
            raise ValueError(f"{path}: use .flac or .wav")
        path.parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(str(path), self.audio, self.sample_rate, subtype=subtype)
        return str(path)

    def save_artifacts(self, directory: str | os.PathLike) -> dict:
        """Upstream's artifacts of a finished song in `directory`: the plan's files (`SymbolicPlan.save`),
        `audio.flac`, `semantic.npy` (codec indices, int32), `latent.npy` (`[T, 64]` float32), `request.json`,
        `config.json` (the effective config) and `result.json` (status, identity, truncated, sample rate, seconds,
        weights, timing and every other file's sha256 and size), which it returns."""
        from ..artifacts import RunDirectory, flac_bytes, npy_bytes
        from ..checkpoint import json_bytes, write_bytes_atomic

        directory = Path(directory)
        self.plan.save(directory)
        files = {"audio.flac": flac_bytes(self.audio, self.sample_rate),
                 "semantic.npy": npy_bytes(np.asarray(self.semantic.tokens, np.int32)),
                 "latent.npy": npy_bytes(np.asarray(self.latents, np.float32)),
                 "request.json": json_bytes(self.request.to_dict()), "config.json": json_bytes(self.config)}
        for name, data in files.items():
            write_bytes_atomic(directory / name, data)
        return RunDirectory(directory).write_result({
            "status": "complete", "identity": self.identity, "truncated": self.truncated,
            "sample_rate": self.sample_rate, "audio_seconds": self.audio_seconds, "weights": self.weights,
            "timing": self.timing})


def truncation_record(seconds: float | None, truncated: dict, generation: dict) -> dict:
    """Per phase its budget cut, what cut it: `by` "seconds" (the request's length, for the song) or "max_tokens"
    (the phase's budget), the token budget and the seconds asked. A song cut either way can be continued."""
    record = {}
    for phase in ("abc", "semantic"):
        if truncated.get(phase):
            by = "seconds" if phase == "semantic" and seconds is not None else "max_tokens"
            record[phase] = {"by": by, "tokens": generation[phase]["max_tokens"],
                             **({"seconds": seconds} if by == "seconds" else {})}
    return record


def check_semantic(semantic: SemanticResult) -> None:
    """What the NAR needs: codec indices, and a prefix of vocabulary ids."""
    if not semantic.tokens:
        raise ValueError("the semantic phase produced no tokens; there is nothing to synthesize")
    check_token_ids(semantic.tokens, "semantic.tokens", 0, CODEC_SIZE, "a codec index")
    check_token_ids(semantic.plan.prefix, "plan.prefix")


BATCH_NOTE = ("the AR tokens may depend on the other songs the engine served at the same time (bf16 on vLLM); "
              "--reproducible (serve: reproducible) makes a seed fix the song")


def kv_cache_record(*timings: dict | None) -> dict:
    """result.json's `kv_cache`: what the vLLM engine ran its K/V as (dtype, attention backend, what the cache
    holds, the scales), as the engine reported it at start (engine.worker.kv_cache_record); {} when no phase ran
    on vLLM."""
    ran = [timing["kv_cache"] for timing in timings if timing and timing.get("kv_cache")]
    return {"kv_cache": ran[0]} if ran else {}


def batch_record(*timings: dict | None) -> dict:
    """result.json's word on reproducibility: whether every AR phase ran batch-invariant, else why not. A phase
    that ran no AR (a given score, cot off: no `backend_actual`) depends on no batch."""
    ran = [timing for timing in timings if timing and "backend_actual" in timing]
    invariant = all(timing.get("batch_invariant", False) for timing in ran)
    return {"batch_invariant": invariant} if invariant else {"batch_invariant": False, "batch_note": BATCH_NOTE}
