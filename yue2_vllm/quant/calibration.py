"""Calibration corpus: sequences the bf16 model generates itself, cut into windows.

Text alone never exercises the codec-token activations, so the corpus is the model's own
abc + semantic output for a request set (lyric sets × contrasting styles × English/Mandarin ×
cot full/melody). Each request's whole sequence is kept (the quality gate teacher-forces the
held-out ones, per phase); all sequences are also cut into windows of at most 8,192 tokens for
calibration, and the manifest says which windows are held out.

Layout: `sequences/<id>.npy`, `windows/<nnnn>.npy` (int32 token ids), `manifest.json`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..checkpoint import atomic_directory, read_json, write_json_atomic
from ..protocol import CODEC_OFFSET, CODEC_SIZE, MUSIC_END, SongRequest

DEFAULT_REQUESTS = Path(__file__).resolve().parents[2] / "calibration" / "requests.json"
MAX_WINDOW = 8192
MANIFEST = "manifest.json"
META_FIELDS = ("lang",)


@dataclass(frozen=True)
class RequestSet:
    requests: list[SongRequest]
    heldout: frozenset[str]
    meta: dict[str, dict]


def load_request_set(path: str | os.PathLike = DEFAULT_REQUESTS) -> RequestSet:
    data = read_json(path)
    requests, meta = [], {}
    for row in data["requests"]:
        fields = {k: v for k, v in row.items() if k not in META_FIELDS}
        request = SongRequest(**fields)
        requests.append(request)
        meta[request.id] = {k: row[k] for k in META_FIELDS if k in row}
    ids = {r.id for r in requests}
    heldout = frozenset(data.get("heldout", []))
    if len(ids) != len(requests) or heldout - ids:
        raise ValueError(f"{path}: request ids must be unique and held-out ids must name requests")
    return RequestSet(requests, heldout, meta)


def song_sequence(prefix: list[int], codec: list[int], ended: bool) -> list[int]:
    """The tokens the model saw and wrote: semantic prompt (incl. the score), codec ids, MUSIC_END if it ended."""
    return list(prefix) + [CODEC_OFFSET + c for c in codec] + ([MUSIC_END] if ended else [])


def phase_targets(base_length: int, abc_count: int, abc_ended: bool, prefix_length: int, sequence_length: int,
                  has_abc_phase: bool) -> dict[str, list[int]]:
    """Index ranges `[start, end)` of the tokens each phase generated (the teacher-forcing targets).

    The abc phase wrote the score (and `</abc>` when it ended) after `base + <abc>`; the
    semantic phase wrote everything after the semantic prompt.
    """
    targets = {"semantic": [prefix_length, sequence_length]}
    if has_abc_phase:
        start = base_length + 1
        targets["abc"] = [start, start + abc_count + int(abc_ended)]
    return targets


def window_ranges(length: int, window: int = MAX_WINDOW) -> list[tuple[int, int]]:
    if not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"window must be in [1, {MAX_WINDOW}], got {window}")
    return [(start, min(start + window, length)) for start in range(0, length, window)]


def codec_share(tokens: np.ndarray) -> float:
    if len(tokens) == 0:
        return 0.0
    return float(((tokens >= CODEC_OFFSET) & (tokens < CODEC_OFFSET + CODEC_SIZE)).mean())


def build_corpus(pipe, request_set: RequestSet, out_dir: str | os.PathLike, *, window: int = MAX_WINDOW,
                 limit: int | None = None, on_request: Callable[[int, int, str], None] | None = None) -> dict:
    """Generate every request with `pipe` (plan + semantic phases) and write the corpus atomically.

    `limit` keeps only the first N training requests (the held-out ones are always generated).
    """
    from ..protocol import base_prompt

    requests = request_set.requests
    if limit is not None:
        train = [r for r in requests if r.id not in request_set.heldout][:limit]
        requests = [r for r in requests if r in train or r.id in request_set.heldout]
    records, windows = [], []
    with atomic_directory(out_dir) as tmp:
        (tmp / "sequences").mkdir()
        (tmp / "windows").mkdir()
        for index, request in enumerate(requests):
            if on_request is not None:
                on_request(index + 1, len(requests), request.id)
            plan = pipe.plan(request)
            semantic = pipe.generate_semantic(plan)
            sequence = np.asarray(song_sequence(plan.prefix, semantic.tokens, not semantic.truncated), np.int32)
            split = "heldout" if request.id in request_set.heldout else "train"
            np.save(tmp / "sequences" / f"{request.id}.npy", sequence)
            base = len(base_prompt(request, pipe.tokenizer))
            records.append({
                "id": request.id, "request": request.to_dict(), **request_set.meta.get(request.id, {}),
                "split": split, "seed": request.seed, "tokens": len(sequence), "abc_tokens": len(plan.abc_ids),
                "semantic_tokens": len(semantic.tokens), "codec_share": codec_share(sequence),
                "truncated": {"abc": plan.truncated, "semantic": semantic.truncated},
                "targets": phase_targets(base, len(plan.abc_ids), not plan.truncated, len(plan.prefix),
                                         len(sequence), request.cot != "off" and request.abc is None),
                "backend": {"abc": plan.timing.get("backend_actual"),
                            "semantic": semantic.timing.get("backend_actual")},
            })
            for start, end in window_ranges(len(sequence), window):
                name = f"{len(windows):04d}.npy"
                np.save(tmp / "windows" / name, sequence[start:end])
                windows.append({"file": f"windows/{name}", "request": request.id, "split": split, "start": start,
                                "tokens": end - start, "codec_share": codec_share(sequence[start:end])})
        train = [w for w in windows if w["split"] == "train"]
        manifest = {
            "version": 1, "window": window, "model": pipe.weights["mot"],
            "generation": pipe.generation_config.to_dict(), "requests": records, "windows": windows,
            "totals": {"requests": len(records), "windows": len(windows), "train_windows": len(train),
                       "tokens": int(sum(w["tokens"] for w in windows)),
                       "train_tokens": int(sum(w["tokens"] for w in train)),
                       "codec_share": float(sum(w["codec_share"] * w["tokens"] for w in windows)
                                            / max(1, sum(w["tokens"] for w in windows)))},
        }
        write_json_atomic(tmp / MANIFEST, manifest)
    return manifest


def load_manifest(corpus_dir: str | os.PathLike) -> dict:
    return read_json(Path(corpus_dir) / MANIFEST)


def heldout_sequences(corpus_dir: str | os.PathLike) -> list[tuple[dict, np.ndarray]]:
    """`(record, tokens)` of each held-out request, for the quality gate."""
    corpus_dir = Path(corpus_dir)
    return [(record, np.load(corpus_dir / "sequences" / f"{record['id']}.npy"))
            for record in load_manifest(corpus_dir)["requests"] if record["split"] == "heldout"]


def train_windows(corpus_dir: str | os.PathLike) -> list[np.ndarray]:
    """Calibration windows, held-out requests excluded."""
    corpus_dir = Path(corpus_dir)
    return [np.load(corpus_dir / w["file"]) for w in load_manifest(corpus_dir)["windows"] if w["split"] == "train"]


def summary(manifest: dict) -> str:
    totals = manifest["totals"]
    return json.dumps({"requests": totals["requests"], "windows": totals["windows"],
                       "train_windows": totals["train_windows"], "tokens": totals["tokens"],
                       "codec_share": round(totals["codec_share"], 3)})
