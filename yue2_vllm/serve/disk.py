"""Disk admission by the song: the bytes a request's budgets can write, and a ledger of what the admitted songs
(queued, held or in flight) may still write, checked against the data dir's free disk before a song is queued.

The bound is the worst case, never a typical ratio: the FLAC as uncompressed 24-bit stereo plus its framing
(libFLAC falls back to verbatim subframes, so white noise never compresses below that; music takes ~60-70 %),
every array at its budget, and JSON records with room for the request text and the score repeated.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ..protocol import SongRequest, SongRules, abc_prompt, semantic_prompt

SAMPLES_PER_FRAME = 1920  # 48 kHz audio samples per latent frame (25 frames/s)
SAMPLE_TRIM = 64  # the VAE's output is 1920·T − 64 samples
CHANNELS, SAMPLE_BYTES = 2, 3  # stereo, 24-bit PCM
LATENT_DIM = 64
FLAC_FRAME_SAMPLES = 1024  # the smallest block libFLAC's presets use (its default is 4096): framing counted per 1024
FLAC_FRAME_OVERHEAD = 32  # a frame's header (<= 16 bytes), two subframe headers and its CRC-16, rounded up
FLAC_METADATA = 64 * 1024  # STREAMINFO, padding, a seek table and tags
NPY_HEADER = 128
TOKEN_TEXT_BYTES = 128  # an upper bound on the UTF-8 bytes of one decoded score token
JSON_ALLOWANCE = 256 * 1024  # stage records, run state, manifest, result, config (beyond the texts below)
RETENTION_SECONDS = 7 * 24 * 3600.0  # finished jobs are purged a week after they finished, by default


@dataclass(frozen=True)
class SongBytes:
    """The most bytes one song writes, by file group."""

    audio: int
    arrays: int
    text: int

    @property
    def total(self) -> int:
        return self.audio + self.arrays + self.text


def flac_bound(samples: int) -> int:
    """The largest 24-bit stereo FLAC of `samples` frames: uncompressed PCM plus framing and metadata."""
    return (samples * CHANNELS * SAMPLE_BYTES + FLAC_FRAME_OVERHEAD * math.ceil(samples / FLAC_FRAME_SAMPLES)
            + FLAC_METADATA)


def song_bytes(prompt_tokens: int, abc_tokens: int, semantic_tokens: int, request_text_bytes: int,
               stage: str = "audio") -> SongBytes:
    """The most a song writes, from its budgets: the prompt before any score, the score's budget (0 for cot off or
    an external score, whose ids are counted in the prompt), the semantic budget (= latent frames) and the UTF-8
    size of its style, lyrics and score text. `stage="plan"` stops after the score's files."""
    score = abc_tokens * 4 + NPY_HEADER  # abc_tokens.npy
    prefix = (prompt_tokens + abc_tokens + 2) * 4 + NPY_HEADER  # prefix.npy: the semantic prompt
    score_text = abc_tokens * TOKEN_TEXT_BYTES  # score.abc, and again in the plan's stage record
    text = JSON_ALLOWANCE + 4 * request_text_bytes + 2 * score_text  # the request in request.json, run state, ...
    if stage == "plan":
        return SongBytes(0, score + prefix, text)
    frames = semantic_tokens
    samples = max(0, SAMPLES_PER_FRAME * frames - SAMPLE_TRIM)
    arrays = score + prefix + (frames * 4 + NPY_HEADER) + (frames * LATENT_DIM * 4 + NPY_HEADER)
    return SongBytes(flac_bound(samples), arrays, text)


def request_bytes(rules: SongRules, request: SongRequest, overrides: dict, stage: str = "audio") -> SongBytes:
    """`song_bytes` for a request under a server's rules (its sampling defaults and tokenizer)."""
    semantic = rules.phase_sampling(request, overrides.get("semantic"), "semantic").max_tokens  # seconds: its cap
    if request.cot == "off" or request.abc is not None:
        prompt, abc = len(semantic_prompt(request, rules.tokenizer)), 0
    else:
        prompt, abc = len(abc_prompt(request, rules.tokenizer)), rules.sampling_for(overrides.get("abc"), "abc").max_tokens
    text = sum(len(value.encode("utf-8")) for value in (request.style, request.lyrics, request.abc or ""))
    return song_bytes(prompt, abc, semantic, text, stage)


def written_bytes(directory: Path) -> int:
    """Bytes of the files a song's directory holds now (0 before it has one)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    total = 0
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
    return total


class DiskLedger:
    """What the admitted, unfinished songs may still write: each song's bound (computed once per job and stage)
    less what its directory already holds. `admit` checks a new song against the free disk under one lock, so
    two requests never both take the last room; the caller queues the song inside `admit`'s block."""

    def __init__(self, jobs_dir: Path, free_bytes: Callable[[Path], int]):
        self.jobs_dir, self.free_bytes = Path(jobs_dir), free_bytes
        self.lock = threading.Lock()
        self._bounds: dict[tuple[str, str], int] = {}

    def bound(self, job_id: str, stage: str, compute: Callable[[], int]) -> int:
        key = (job_id, stage)
        if key not in self._bounds:
            self._bounds[key] = compute()
        return self._bounds[key]

    def outstanding(self, jobs: Iterable[tuple[str, str, Callable[[], int]]]) -> int:
        """Bytes the unfinished `jobs` (`(id, stage, bound)`) may still write; bounds of other jobs are forgotten."""
        keep, total = {}, 0
        for job_id, stage, compute in jobs:
            bound = self.bound(job_id, stage, compute)
            keep[(job_id, stage)] = bound
            total += max(0, bound - written_bytes(self.jobs_dir / job_id))
        self._bounds = keep
        return total

    def room(self, need: int, pending: int, headroom: int) -> tuple[bool, int]:
        """Whether a song of `need` bytes fits beside `pending` ones with `headroom` kept free; and the free bytes."""
        free = self.free_bytes(self.jobs_dir)
        return free - pending - headroom >= need, free
