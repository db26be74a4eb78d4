"""A song run into a directory: each stage checkpointed with a record of its files' hashes, the run's state
after every stage (failed, cancelled, complete) and `result.json` at the end, so that a crashed or cancelled
run resumes from the last stage whose files still verify (artifacts.RunDirectory keeps the files)."""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from .. import artifacts as art
from .. import instrumental
from ..checkpoint import identity, write_json_atomic
from ..protocol import CODEC_SIZE, SongRequest
from .continuation import RNG_FILE, ParentSong, check_adapters, check_continuable, exactness
from .results import (SAMPLE_RATE, Cancelled, Decoder, OnProgress, OnStage, OnToken, SemanticResult, SymbolicPlan,
                      Synthesizer, batch_record, kv_cache_record, truncation_record)

if TYPE_CHECKING:
    from .adapters import AdapterRequest

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
    config), so a renamed adapter keeps its songs' identities; a cover's transcription record left out, so a song
    depends on its score and not on where the score came from."""
    data = request.to_dict()
    data.pop("adapters", None)
    data.pop("transcription", None)
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


class SongRun:
    """`song` (a pipeline: its stages, identities and records) run into `directory`; see
    `YuE2Pipeline.generate_to`. With `parent` the run continues that capped song (song/continuation.py): its plan
    is copied and its semantic phase goes on from the parent's codes. `adapters`: the song's, as the caller's
    `check_request` resolved them (None: checked and resolved here); every stage and record reads them. A
    continuation whose model, generation config or adapters are not its parent's is refused here, before anything
    is written (ContinueRefused).

    A method per stage makes its files and meta (`_plan`, `_semantic`, `_synthesis`, `_audio`); `_stage` keeps
    every stage's bookkeeping (a checkpoint that verifies is reused, else the stage is redone and the later ones
    forgotten; `on_stage` told; the meta recorded); `run` goes through them, reads each stage's outputs back from
    its files, keeps the run's state and writes result.json."""

    def __init__(self, song, directory: str | os.PathLike, request: SongRequest, *, resume: bool = False,
                 abc_sampling=None, semantic_sampling=None, stage: str = "audio",
                 cancelled: Cancelled | None = None, on_token: OnToken | None = None,
                 on_progress: OnProgress | None = None, on_stage: OnStage | None = None,
                 synthesizer: Synthesizer | None = None, decoder: Decoder | None = None,
                 parent: ParentSong | None = None, adapters: AdapterRequest | None = None):
        if stage not in ("plan", "audio"):
            raise ValueError(f"stage must be 'plan' or 'audio', got {stage!r}")
        if adapters is None:
            adapters = song.check_request(request, abc_sampling, semantic_sampling)  # before anything is written
        self.adapters = adapters
        if parent is not None:  # every path's continuation (the API's, the CLI's, a scheduler's job) passes here
            check_continuable(parent, song.weights, song.generation_config, directory)
            check_adapters(parent, adapters)
        self.song, self.request, self.resume, self.stage, self.parent = song, request, resume, stage, parent
        self.abc_sampling, self.semantic_sampling = abc_sampling, semantic_sampling
        self.cancelled, self.on_token, self.on_progress, self.on_stage = cancelled, on_token, on_progress, on_stage
        self.synthesizer, self.decoder = synthesizer or song.synthesize, decoder or song.decode
        self.config = song.effective_config(request, abc_sampling, semantic_sampling, adapters=adapters)
        self.run_id = song.run_identity(request, self.config)
        # The directory belongs to the latents' identity, so a changed VAE redoes only the audio stage.
        self.latent_id = song.latent_identity(request, self.config)
        self.rundir = art.RunDirectory(directory)
        self.continued = False  # an earlier run goes on (known once `run` claims the directory)
        self.current = "plan"  # the stage in progress (its failed state names it)
        self.verified: list[str] | None = []  # the stages a resume kept, until one is redone (then None)
        self.reused: list[str] = []  # the stages taken from verified checkpoints (result.json's stages_reused)

    def run(self) -> dict:
        """The result.json document, or with `stage="plan"` the plan record."""
        request = self.request
        self.continued = self.rundir.start(self.latent_id, request.to_dict(), resume=self.resume)
        finished = self.rundir.verified_result(self.run_id)
        if finished is not None and self.stage == "audio":
            LOG.info("resuming: the finished song verifies, nothing to redo")
            return self.rundir.reuse_result(finished, art.STAGES)
        try:
            plan_meta = self._stage("plan", self._plan)
            plan = self._planned(plan_meta)
            if self.stage == "plan":
                return {"status": "planned", "identity": self.run_id, "resumed": self.reused == ["plan"],
                        "stages_reused": list(self.reused), **plan_meta}
            semantic = self._generated(plan, self._stage("semantic", self._semantic, plan))
            synthesis_meta = self._stage("synthesis", self._synthesis, semantic)
            latents = self._synthesized()
            audio_meta = self._stage("audio", self._audio, latents)
            document = self._result(plan, semantic, synthesis_meta, audio_meta)
        except BaseException as exc:
            self._set_state("cancelled" if isinstance(exc, (InterruptedError, KeyboardInterrupt))
                            else FAILED_STATES[self.current], exc)
            raise
        self._set_state("complete")
        return document

    def _stage(self, name: str, compute: Callable[..., tuple[dict[str, bytes], dict]], *inputs) -> dict:
        """The stage's recorded meta if it verifies; otherwise `compute(*inputs)` redoes it (and later stages are
        forgotten)."""
        self.current = name
        stage_id = self.run_id if name == "audio" else self.latent_id
        meta = self.rundir.verified_stage(name, stage_id, *STAGE_RECORDS[name])
        if meta is None and self.continued and self.verified is not None:  # say what a resume keeps, once
            LOG.info("resuming: %s verified, redoing %s", ", ".join(self.verified) or "no stage", name)
            self.verified = None
        if meta is None:
            self.rundir.stop_claiming(name, self.latent_id, self.request.to_dict())  # before its record goes
            self.rundir.discard_from(name)
            if self.on_stage is not None:
                self.on_stage(name, "start", None)
            files, meta = compute(*inputs)
            self.rundir.write_stage(name, stage_id, files, meta)
            if self.on_stage is not None:
                self.on_stage(name, "done", meta)
        else:
            if self.verified is not None:
                self.verified.append(name)
            self.reused.append(name)
            if self.on_stage is not None:
                self.on_stage(name, "reused", meta)
        return meta

    def _read(self, name: str) -> np.ndarray:
        return art.load_npy(self.rundir.path / name)

    # -- each stage's outputs read back from its files (what a resumed run has too), and the state reached

    def _planned(self, meta: dict) -> SymbolicPlan:
        plan = SymbolicPlan(instrumental.rendered_request(meta, self.request), meta["abc"],
                            self._read("abc_tokens.npy").astype(int).tolist(),
                            self._read("prefix.npy").astype(int).tolist(), meta["timing"], meta["truncated"],
                            adapters=self.adapters)
        self._set_state("planned")
        return plan

    def _generated(self, plan: SymbolicPlan, meta: dict) -> SemanticResult:
        tokens = self._read("semantic.npy").astype(int).tolist()
        if any(not 0 <= t < CODEC_SIZE for t in tokens):
            raise ValueError(f"{self.rundir.path / 'semantic.npy'}: holds ids outside the codec range")
        self._set_state("semantic_generated")
        return SemanticResult(plan, tokens, meta["timing"], meta["truncated"])

    def _synthesized(self) -> np.ndarray:
        latents = self._read("latent.npy")
        self._set_state("synthesized")
        return latents

    def _set_state(self, state: str, error: BaseException | None = None) -> None:
        """The run's state; a failure's own error is the one to report, and a complete song's authority is its
        result.json, so a state that cannot be written (e.g. the disk is full) is not raised for them."""
        try:
            self.rundir.set_state(self.latent_id, self.request.to_dict(), state,
                                  **({"error": f"{type(error).__name__}: {error}"} if error is not None else {}))
        except OSError as exc:
            if state == "complete":
                LOG.warning("%s: the song is complete but its run state could not be updated (%s)",
                            self.rundir.path, exc)
            elif error is None:
                raise

    # -- the stages: each makes its files and meta

    def _plan(self) -> tuple[dict[str, bytes], dict]:
        if self.parent is not None:  # a cap changes no score: the parent's plan is the longer request's
            return self.parent.child_plan(self.request)
        plan = self.song.plan(self.request, abc_sampling=self.abc_sampling, cancelled=self.cancelled,
                              on_token=self.on_token, adapters=self.adapters)
        files = {"prefix.npy": art.npy_bytes(np.asarray(plan.prefix, np.int32)),
                 "abc_tokens.npy": art.npy_bytes(np.asarray(plan.abc_ids, np.int32))}
        if plan.abc is not None:
            files["score.abc"] = plan.abc.encode("utf-8")
        meta = {"abc": plan.abc, "timing": plan.timing, "truncated": plan.truncated}
        if plan.instrumental is not None:  # planned.abc, instrumental.json: each step of the recipe
            files.update(instrumental.plan_files(plan.instrumental))
            meta["instrumental"] = plan.instrumental.record()
        return files, meta

    def _semantic(self, plan: SymbolicPlan) -> tuple[dict[str, bytes], dict]:
        parent = self.parent
        semantic = self.song.generate_semantic(plan, sampling=self.semantic_sampling, cancelled=self.cancelled,
                                               on_token=self.on_token,
                                               continuation=parent.ar_continuation() if parent is not None else None)
        files = {"semantic.npy": art.npy_bytes(np.asarray(semantic.tokens, np.int32))}
        if semantic.truncated and semantic.rng_state is not None:  # what a continuation's generator goes on from
            files[RNG_FILE] = art.npy_bytes(np.frombuffer(semantic.rng_state, dtype=np.uint8))
        return files, {"timing": semantic.timing, "truncated": semantic.truncated}

    def _synthesis(self, semantic: SemanticResult) -> tuple[dict[str, bytes], dict]:
        start = time.perf_counter()
        latents = self.synthesizer(semantic, cancelled=self.cancelled, on_progress=self.on_progress)
        return {"latent.npy": art.npy_bytes(latents)}, {"nar_seconds": time.perf_counter() - start,
                                                        "offload_ar": self.song.options.device.offload_ar,
                                                        "peak_memory_bytes": peak_memory_bytes(self.song.device),
                                                        **semantic.synthesis}

    def _audio(self, latents: np.ndarray) -> tuple[dict[str, bytes], dict]:
        start = time.perf_counter()
        audio = self.decoder(latents, cancelled=self.cancelled, on_progress=self.on_progress)
        return ({"audio.flac": art.flac_bytes(audio, SAMPLE_RATE)},
                {"vae_seconds": time.perf_counter() - start, "samples": len(audio)})

    def _result(self, plan: SymbolicPlan, semantic: SemanticResult, synthesis_meta: dict, audio_meta: dict) -> dict:
        """The request, effective config and result.json written; the result document."""
        song, request, config, parent, adapters = self.song, self.request, self.config, self.parent, self.adapters
        write_json_atomic(self.rundir.path / "request.json", request.to_dict())
        write_json_atomic(self.rundir.path / "config.json", config)
        timing = {"abc": plan.timing, "semantic": semantic.timing, "nar_seconds": synthesis_meta["nar_seconds"],
                  "vae_seconds": audio_meta["vae_seconds"], "load": song.load_timing}
        return self.rundir.write_result({
            # resumed: as upstream, only a finished result reused untouched (reuse_result) says True
            "status": "complete", "identity": self.run_id, "resumed": False, "stages_reused": list(self.reused),
            **({"instrumental": True} if request.instrumental else {}),  # its steps: instrumental.json
            # a cover: where its score came from (the run's transcription.json, where a face wrote one, has the notes)
            **({"transcription": request.transcription} if request.transcription is not None else {}),
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
