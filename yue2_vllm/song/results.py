"""What each stage hands the next: the plan (ABC score and semantic prompt), the semantic tokens, the finished song;
and the callbacks stages report through."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..instrumental import InstrumentalSteps
from ..protocol import CODEC_SIZE, SongRequest, check_token_ids

if TYPE_CHECKING:
    from .adapters import AdapterRequest

SAMPLE_RATE = 48000
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
    def truncated(self) -> dict:
        return {"abc": self.plan.truncated, "semantic": self.semantic.truncated}

    @property
    def truncation(self) -> dict:
        """Why each cut phase stopped (see `truncation_record`)."""
        return truncation_record(self.request.seconds, self.truncated, self.config["generation"])

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / self.sample_rate


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
