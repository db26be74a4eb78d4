"""A song run into a directory: each stage checkpointed with a record of its files' hashes, the run's state
after every stage (failed, cancelled, complete) and `result.json` at the end, so that a crashed or cancelled
run resumes from the last stage whose files still verify (artifacts.RunDirectory keeps the files)."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import numpy as np
import torch

from .. import artifacts as art
from .. import instrumental
from ..checkpoint import identity, write_json_atomic
from ..protocol import CODEC_SIZE, SongRequest
from .continuation import RNG_FILE, ParentSong, check_continuable, exactness
from .results import (SAMPLE_RATE, Cancelled, Decoder, OnProgress, OnStage, OnToken, SemanticResult, SymbolicPlan,
                      Synthesizer, batch_record, kv_cache_record, truncation_record)

LOG = logging.getLogger(__name__)
# Per stage: the files its record must list (with hashes) and the meta keys the later stages read.
STAGE_RECORDS = {"plan": (("prefix.npy", "abc_tokens.npy"), ("abc", "timing", "truncated")),
                 "semantic": (("semantic.npy",), ("timing", "truncated")),
                 "synthesis": (("latent.npy",), ("nar_seconds",)),
                 "audio": (("audio.flac",), ("vae_seconds", "samples"))}
# Effective-config keys only the audio (VAE) stage depends on.
AUDIO_CONFIG_KEYS = ("vae_dtype", "vae_decode", "vae_core_frames", "vae_halo_frames", "decoder_release")
# Run states of a failed stage, named as upstream's.
FAILED_STATES = {"plan": "plan_failed", "semantic": "semantic_failed", "synthesis": "synthesis_failed",
                 "audio": "decode_failed"}


def identity_request(request: SongRequest) -> dict:
    """The request as its identity holds it: adapters' names left out (their content hashes and scales are in the
    config), so a renamed adapter keeps its songs' identities."""
    data = request.to_dict()
    data.pop("adapters", None)
    return data


def run_identity(request: SongRequest, config: dict, weights: dict) -> str:
    """The song's identity: request, effective config and all weights (upstream's request identity)."""
    return identity({"request": identity_request(request), "config": config, "weights": weights})


def latent_identity(request: SongRequest, config: dict, weights: dict) -> str:
    """What the plan, semantic and latent stages depend on (the directory's identity): the song's without the VAE,
    so that a changed VAE redoes only the audio stage."""
    return identity({"request": identity_request(request),
                     "config": {k: v for k, v in config.items() if k not in AUDIO_CONFIG_KEYS},
                     "weights": {"mot": weights["mot"]}})


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes so far: CUDA max allocated on an accelerator, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def generate_to(song, directory: str | os.PathLike, request: SongRequest, *, resume: bool = False,
                abc_sampling=None, semantic_sampling=None, stage: str = "audio",
                cancelled: Cancelled | None = None, on_token: OnToken | None = None,
                on_progress: OnProgress | None = None, on_stage: OnStage | None = None,
                synthesizer: Synthesizer | None = None, decoder: Decoder | None = None,
                parent: ParentSong | None = None, adapters=None) -> dict:
    """Run `song` (a pipeline: its stages, identities and records) into `directory`; see
    `YuE2Pipeline.generate_to`. With `parent` the run continues that capped song (song/continuation.py): its plan
    is copied and its semantic phase goes on from the parent's codes. `adapters`: the song's, as the caller's
    `check_request` resolved them (None: checked and resolved here); every stage and record reads them."""
    if stage not in ("plan", "audio"):
        raise ValueError(f"stage must be 'plan' or 'audio', got {stage!r}")
    if adapters is None:
        adapters = song.check_request(request, abc_sampling, semantic_sampling)  # before anything is written
    if parent is not None:
        check_continuable(parent, song.weights, song.generation_config, directory)
    config = song.effective_config(request, abc_sampling, semantic_sampling, adapters=adapters)
    run_id = song.run_identity(request, config)
    # The directory belongs to the latents' identity, so a changed VAE redoes only the audio stage.
    latent_id = song.latent_identity(request, config)
    run = art.RunDirectory(directory)
    continued = run.start(latent_id, request.to_dict(), resume=resume)  # an earlier run goes on
    finished = run.verified_result(run_id)
    if finished is not None and stage == "audio":
        LOG.info("resuming: the finished song verifies, nothing to redo")
        return run.reuse_result(finished, art.STAGES)
    current = {"stage": "plan", "verified": []}  # verified: the stages a resume kept, until one is redone
    reused: list[str] = []  # the stages taken from verified checkpoints (result.json's stages_reused)

    def stage_meta(name: str, compute: Callable[[], tuple[dict[str, bytes], dict]]) -> dict:
        """The stage's recorded meta if it verifies; otherwise redo it (and forget later stages)."""
        current["stage"] = name
        stage_id = run_id if name == "audio" else latent_id
        meta = run.verified_stage(name, stage_id, *STAGE_RECORDS[name])
        if meta is None and continued and current["verified"] is not None:  # say what a resume keeps, once
            LOG.info("resuming: %s verified, redoing %s", ", ".join(current["verified"]) or "no stage", name)
            current["verified"] = None
        if meta is None:
            run.stop_claiming(name, latent_id, request.to_dict())  # before its record goes
            run.discard_from(name)
            if on_stage is not None:
                on_stage(name, "start", None)
            files, meta = compute()
            run.write_stage(name, stage_id, files, meta)
            if on_stage is not None:
                on_stage(name, "done", meta)
        else:
            if current["verified"] is not None:
                current["verified"].append(name)
            reused.append(name)
            if on_stage is not None:
                on_stage(name, "reused", meta)
        return meta

    def compute_plan():
        if parent is not None:  # a cap changes no score: the parent's plan is the longer request's
            return parent.child_plan(request)
        plan = song.plan(request, abc_sampling=abc_sampling, cancelled=cancelled, on_token=on_token,
                         adapters=adapters)
        files = {"prefix.npy": art.npy_bytes(np.asarray(plan.prefix, np.int32)),
                 "abc_tokens.npy": art.npy_bytes(np.asarray(plan.abc_ids, np.int32))}
        if plan.abc is not None:
            files["score.abc"] = plan.abc.encode("utf-8")
        meta = {"abc": plan.abc, "timing": plan.timing, "truncated": plan.truncated}
        if plan.instrumental is not None:  # planned.abc, instrumental.json: each step of the recipe
            files.update(instrumental.plan_files(plan.instrumental))
            meta["instrumental"] = plan.instrumental.record()
        return files, meta

    def compute_semantic():
        semantic = song.generate_semantic(plan, sampling=semantic_sampling, cancelled=cancelled, on_token=on_token,
                                          continuation=parent.ar_continuation() if parent is not None else None)
        files = {"semantic.npy": art.npy_bytes(np.asarray(semantic.tokens, np.int32))}
        if semantic.truncated and semantic.rng_state is not None:  # what a continuation's generator goes on from
            files[RNG_FILE] = art.npy_bytes(np.frombuffer(semantic.rng_state, dtype=np.uint8))
        return files, {"timing": semantic.timing, "truncated": semantic.truncated}

    def compute_latents():
        start = time.perf_counter()
        latents = (synthesizer or song.synthesize)(semantic, cancelled=cancelled, on_progress=on_progress)
        return {"latent.npy": art.npy_bytes(latents)}, {"nar_seconds": time.perf_counter() - start,
                                                        "offload_ar": song.options.device.offload_ar,
                                                        "peak_memory_bytes": peak_memory_bytes(song.device),
                                                        **semantic.synthesis}

    def compute_audio():
        start = time.perf_counter()
        audio = (decoder or song.decode)(latents, cancelled=cancelled, on_progress=on_progress)
        return ({"audio.flac": art.flac_bytes(audio, SAMPLE_RATE)},
                {"vae_seconds": time.perf_counter() - start, "samples": len(audio)})

    try:
        plan_meta = stage_meta("plan", compute_plan)
        plan = SymbolicPlan(instrumental.rendered_request(plan_meta, request), plan_meta["abc"],
                            art.load_npy(run.path / "abc_tokens.npy").astype(int).tolist(),
                            art.load_npy(run.path / "prefix.npy").astype(int).tolist(),
                            plan_meta["timing"], plan_meta["truncated"], adapters=adapters)
        run.set_state(latent_id, request.to_dict(), "planned")
        if stage == "plan":
            return {"status": "planned", "identity": run_id, "resumed": reused == ["plan"],
                    "stages_reused": list(reused), **plan_meta}
        semantic_meta = stage_meta("semantic", compute_semantic)
        tokens = art.load_npy(run.path / "semantic.npy").astype(int).tolist()
        if any(not 0 <= t < CODEC_SIZE for t in tokens):
            raise ValueError(f"{run.path / 'semantic.npy'}: holds ids outside the codec range")
        semantic = SemanticResult(plan, tokens, semantic_meta["timing"], semantic_meta["truncated"])
        run.set_state(latent_id, request.to_dict(), "semantic_generated")
        synthesis_meta = stage_meta("synthesis", compute_latents)
        latents = art.load_npy(run.path / "latent.npy")
        run.set_state(latent_id, request.to_dict(), "synthesized")
        audio_meta = stage_meta("audio", compute_audio)
        write_json_atomic(run.path / "request.json", request.to_dict())
        write_json_atomic(run.path / "config.json", config)
        timing = {"abc": plan.timing, "semantic": semantic.timing, "nar_seconds": synthesis_meta["nar_seconds"],
                  "vae_seconds": audio_meta["vae_seconds"], "load": song.load_timing}
        document = run.write_result({
            # resumed: as upstream, only a finished result reused untouched (reuse_result) says True
            "status": "complete", "identity": run_id, "resumed": False, "stages_reused": list(reused),
            **({"instrumental": True} if request.instrumental else {}),  # its steps: instrumental.json
            # the adapters the song ran with (an instrumental adapter's recipe adds its adapter to the render)
            **({"adapters": adapters.record()} if adapters else {}),
            **batch_record(plan.timing, semantic.timing),
            **{key: config[key] for key in ("kv_cache_dtype",) if key in config},  # an FP8 KV engine's form
            **kv_cache_record(plan.timing, semantic.timing),  # what the engine ran, read back from it
            "sources": song.source_records(),
            "truncated": {"abc": plan.truncated, "semantic": semantic.truncated},
            "truncation": truncation_record(request.seconds, {"abc": plan.truncated, "semantic": semantic.truncated},
                                            config["generation"]),
            **({"continued_from": parent.record(), "continuation": exactness(parent, config, semantic.timing)}
               if parent is not None else {}),
            "sample_rate": SAMPLE_RATE, "audio_seconds": audio_meta["samples"] / SAMPLE_RATE,
            "weights": song.weights, "timing": timing,
        })
    except BaseException as exc:
        cancelled_run = isinstance(exc, (InterruptedError, KeyboardInterrupt))
        state = "cancelled" if cancelled_run else FAILED_STATES[current["stage"]]
        try:
            run.set_state(latent_id, request.to_dict(), state, error=f"{type(exc).__name__}: {exc}")
        except OSError:  # e.g. the disk is still full: the original error is the one to report
            pass
        raise
    try:
        run.set_state(latent_id, request.to_dict(), "complete")
    except OSError as exc:  # result.json, the authority, is complete and verifies
        LOG.warning("%s: the song is complete but its run state could not be updated (%s)", run.path, exc)
    return document
