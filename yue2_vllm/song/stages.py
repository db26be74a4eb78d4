"""The four stages of a song, each taking the previous one's result: plan (the ABC score, or the given one),
semantic tokens (both AR phases route through `generate_ar`: vLLM when it serves, else the torch lane),
synthesis (the NAR's flow matching, one song or a batch) and decode (the VAE's tiled decode)."""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch

from .. import instrumental
from ..memory import vae_decode_bytes
from ..model.lora import applied
from ..model.nar import SongInput, synthesize_many
from ..model.nar import synthesize as nar_synthesize
from ..model.sampling import ARBackend, ARContinuation, ARResult
from ..model.torch_quant import prepare_ar_proxies, restore_ar
from ..options import PipelineOptions
from ..protocol import (CODEC_OFFSET, Sampling, SongRequest, SongRules, abc_prompt, check_abc_ids,
                        check_token_ids, negative_prompt, semantic_prompt)
from ..room import DeviceRoom
from ..tokenizer import YuE2Tokenizer
from .adapters import AdapterRequest, ServedAdapters
from .admission import admitted, nar_need, torch_ar_admitted
from .models import VAE_HALO_FRAMES
from .results import Cancelled, OnProgress, OnToken, SemanticResult, SymbolicPlan, check_semantic

LOG = logging.getLogger(__name__)


@dataclass
class SongStages:
    """The stages over one pipeline's parts. The callables read state that changes while the pipeline serves:
    `select_backend(cfg_scale, legacy_off)` the AR backend and its fallback reason, `room()` where buffers are
    admitted now, `release_engine()` the engine before a NAR run, `vae_on_device(vae, core_frames)` that VAE placed
    for a decode of tiles of that many frames."""

    model: object
    tokenizer: YuE2Tokenizer
    rules: SongRules
    options: PipelineOptions  # the pipeline's, its defaults filled in (the VAE tile, the budget)
    torch_backend: ARBackend
    torch_lock: threading.RLock  # the torch lane; with load-time proxies it also covers synthesis
    proxy_mode: str | None
    ar_on_device: bool
    adapters: ServedAdapters  # the registered adapters: what each song's request names (resolved once per song)
    select_backend: Callable[[float, bool], tuple[ARBackend, str | None]]
    room: Callable[[], DeviceRoom | None]
    release_engine: Callable[[], None]
    vae_on_device: Callable[..., contextlib.AbstractContextManager]
    beside_engine: bool  # the AR half may run on vLLM (resolved.beside_engine): a song's AR adapters need a LoRA

    # -- the AR half

    def resolve_adapters(self, request: SongRequest) -> AdapterRequest:
        """The song's adapters, for a stage called without them (a song admitted by `check_request` carries them:
        `SymbolicPlan.adapters`)."""
        return self.adapters.resolve(request, engine=self.beside_engine)

    def generate_ar(self, prefix, sampling: Sampling, request: SongRequest, phase: str, adapters: AdapterRequest,
                    **kwargs) -> ARResult:
        backend, reason = self.select_backend(kwargs.get("cfg_scale", 1.0), kwargs.get("legacy_off", False))
        continuation: ARContinuation | None = kwargs.get("continuation")
        if continuation is not None and continuation.backend == "torch" and backend is not self.torch_backend:
            backend, reason = self.torch_backend, ("continuing a song whose semantic phase ran on the torch "
                                                   "backend: its tokens and generator go on there")
        if reason is not None:
            LOG.info("%s phase: torch backend (%s)", phase, reason)
        if backend is self.torch_backend:  # the song's AR adapters as run-time edits (model/lora.py)
            with self.torch_lock, torch_ar_admitted(self.room(), self.model, len(prefix), sampling, phase, kwargs), \
                    applied(self.model, adapters.ar_edits()):
                if self.proxy_mode:
                    prepare_ar_proxies(self.model, self.proxy_mode)  # idempotent; undone before each NAR stage
                result = backend.generate(prefix, sampling, request.seed, phase, **kwargs)
        else:  # on vLLM: one LoRA per request (engine/lora.py)
            lora = adapters.prepared_lora()
            result = backend.generate(prefix, sampling, request.seed, phase, **kwargs,
                                      **({"lora": lora} if lora is not None else {}))
        timing = {**result.timing, "backend_requested": self.options.ar.backend, "fallback_reason": reason}
        timing.setdefault("batch_invariant", True)  # the torch backend serves one song per forward pass
        return result._replace(timing=timing)

    def plan(self, request: SongRequest, *, abc_sampling=None, cancelled: Cancelled | None = None,
             on_token: OnToken | None = None, adapters: AdapterRequest | None = None) -> SymbolicPlan:
        """The song's score; `adapters` what `check_request` resolved for it (None: resolved here), carried on
        the plan to the later stages."""
        adapters = adapters if adapters is not None else self.resolve_adapters(request)
        if request.instrumental and adapters.instrumental is not None:  # the instrumental adapter's card: one pass
            steps = instrumental.adapter_steps(request, adapters.instrumental.ref)
            return replace(self.plan(steps.render, abc_sampling=abc_sampling, cancelled=cancelled,
                                     on_token=on_token, adapters=adapters), instrumental=steps)
        if request.instrumental:  # upstream's recipe: plan, move the vocal melody to Ins, render the edited score
            steps = instrumental.plan_steps(request, lambda asked: self.plan(
                asked, abc_sampling=abc_sampling, cancelled=cancelled, on_token=on_token, adapters=adapters))
            plan = self.plan(steps.render, adapters=adapters)
            return replace(plan, timing={**plan.timing, **steps.timing}, instrumental=steps)
        tokenizer = self.tokenizer
        if request.cot == "off":
            return SymbolicPlan(request, None, [], semantic_prompt(request, tokenizer),
                                {"seconds": 0.0, "output_tokens": 0}, adapters=adapters)
        if request.abc is not None:
            abc_ids = tokenizer.encode(request.abc)
            return SymbolicPlan(request, request.abc, abc_ids, semantic_prompt(request, tokenizer, abc_ids),
                                {"seconds": 0.0, "output_tokens": 0, "external_prefix_tokens": len(abc_ids)},
                                adapters=adapters)
        ids, timing, truncated, _ = self.generate_ar(
            abc_prompt(request, tokenizer), self.rules.phase_sampling(request, abc_sampling, "abc"), request, "abc",
            adapters, on_token=on_token, cancelled=cancelled)
        return SymbolicPlan(request, tokenizer.decode(ids), ids, semantic_prompt(request, tokenizer, ids),
                            timing, truncated, adapters=adapters)

    def generate_semantic(self, plan: SymbolicPlan, *, sampling=None, cancelled: Cancelled | None = None,
                          on_token: OnToken | None = None,
                          continuation: ARContinuation | None = None) -> SemanticResult:
        """The song's codec tokens; a `continuation` goes on from a capped song's (song/continuation.py), on the
        backend that made them where it can."""
        request, tokenizer = plan.request, self.tokenizer
        check_token_ids(plan.prefix, "plan.prefix")  # 1.0 == 1 would pass the comparison below
        expected = semantic_prompt(request, tokenizer, check_abc_ids(plan.abc_ids) if request.cot != "off"
                                   else None)
        if plan.prefix != expected:
            raise ValueError("plan.prefix does not match the request and its abc ids")
        negative = None
        if request.guidance != 1.0:
            negative = negative_prompt(request, tokenizer, plan.abc_ids)
        extra = {"continuation": continuation} if continuation is not None else {}
        ids, timing, truncated, rng_state = self.generate_ar(
            plan.prefix, self.rules.phase_sampling(request, sampling, "semantic"), request, "semantic",
            self._adapters_of(plan), negative=negative, cfg_scale=request.guidance, legacy_off=request.cot == "off", on_token=on_token,
            cancelled=cancelled, **extra)
        return SemanticResult(plan, [i - CODEC_OFFSET for i in ids], timing, truncated, rng_state=rng_state)

    # -- the NAR and the VAE

    def nar_need(self, semantics: Sequence[SemanticResult]) -> int:
        return nar_need(self.model.config, semantics, self.options.generation.context, self.ar_on_device)

    def _adapters_of(self, plan: SymbolicPlan) -> AdapterRequest:
        return plan.adapters if plan.adapters is not None else self.resolve_adapters(plan.request)

    def _nar_edits(self, semantic: SemanticResult):
        """The song's adapters for the NAR: its AR parts in the prefix prefill, its NAR parts in the velocity."""
        return self._adapters_of(semantic.plan).nar_edits()

    def _nar_lane(self):
        """With load-time proxies the NAR must not run while they are swapped in: it takes the torch lane."""
        return self.torch_lock if self.proxy_mode else contextlib.nullcontext()

    def _prepare_nar(self) -> None:
        self.release_engine()
        if self.proxy_mode:
            restore_ar(self.model)

    def synthesize(self, semantic: SemanticResult, *, cancelled: Cancelled | None = None,
                   on_progress: OnProgress | None = None) -> np.ndarray:
        """One song's latents `[T, 64]`: upstream's one-song path, bit for bit."""
        check_semantic(semantic)
        progress = (lambda done, total: on_progress("nar", done, total)) if on_progress else None
        record = semantic.synthesis
        with admitted(self.room(), self.nar_need([semantic]), "nar of 1 song", [on_progress], cancelled, [record]), \
                self._nar_lane():
            self._prepare_nar()
            generation = self.options.generation
            latents = nar_synthesize(self.model, semantic.plan.prefix, semantic.tokens, semantic.plan.request.seed,
                                     steps=generation.ode_steps, context=generation.context,
                                     cancelled=cancelled, on_progress=progress,
                                     offload_ar=self.options.device.offload_ar, record=record,
                                     edits=self._nar_edits(semantic))
        return latents.numpy()

    def synthesize_many(self, semantics: Sequence[SemanticResult], *, cancelled: Sequence[Cancelled | None] = (),
                        on_progress: Sequence[OnProgress | None] = ()) -> list[np.ndarray | BaseException]:
        """Several songs' latents in one batched flow matching (within bf16 rounding of `synthesize`);
        per song its latents or the exception that ended it."""
        results: list[np.ndarray | BaseException | None] = [None] * len(semantics)
        songs, batched = [], []
        for index, semantic in enumerate(semantics):
            try:
                check_semantic(semantic)
            except ValueError as exc:  # that song fails alone
                results[index] = exc
                continue
            report = on_progress[index] if index < len(on_progress) else None
            songs.append(SongInput(semantic.plan.prefix, semantic.tokens, semantic.plan.request.seed,
                                   cancelled[index] if index < len(cancelled) else None,
                                   (lambda done, total, r=report: r("nar", done, total)) if report else None,
                                   semantic.synthesis, self._nar_edits(semantic)))
            batched.append(index)
        chosen = [semantics[i] for i in batched]
        reports = [on_progress[i] for i in batched if i < len(on_progress)]
        with admitted(self.room(), self.nar_need(chosen), f"nar of {len(chosen)} songs", reports, None,
                      [s.synthesis for s in chosen]), self._nar_lane():
            self._prepare_nar()
            generation = self.options.generation
            latents = synthesize_many(self.model, songs, steps=generation.ode_steps, context=generation.context,
                                      offload_ar=self.options.device.offload_ar)
        for index, result in zip(batched, latents):
            results[index] = result.numpy() if isinstance(result, torch.Tensor) else result
        return results

    def decode(self, vae, latents: np.ndarray, *, full: bool = False, cancelled: Cancelled | None = None,
               on_progress: OnProgress | None = None) -> np.ndarray:
        """`[T, 64]` (or upstream's `[1, 64, T]`) latents → `[1920·T − 64, 2]` float32 audio clamped to [-1, 1]:
        in tiles of the pipeline's `vae_core_frames`, or with `full` in one pass (upstream's `full=True`)."""
        latents = torch.as_tensor(np.asarray(latents, dtype=np.float32))
        dim = vae.config.latent_dim
        if latents.ndim == 3 and latents.shape[0] == 1 and latents.shape[1] == dim:
            latents = latents[0].T
        if latents.ndim != 2 or latents.shape[1] != dim:
            raise ValueError(f"latents must be [frames, {dim}] or [1, {dim}, frames], got {list(latents.shape)}")
        progress = (lambda done, total: on_progress("vae", done, total)) if on_progress else None
        core_frames = len(latents) if full else self.options.device.vae_core_frames
        halo_frames = 0 if full else VAE_HALO_FRAMES
        tile = vae_decode_bytes(vae.config, core_frames, halo_frames)
        with admitted(self.room(), tile, "vae tile", [on_progress], cancelled), \
                self.vae_on_device(vae, core_frames) as placed:
            if full:
                if cancelled is not None and cancelled():
                    raise InterruptedError("cancelled before the VAE")
                audio = placed.decode(latents.T[None])[0].cpu()
                if progress is not None:
                    progress(1, 1)
            else:
                audio = placed.decode_tiled(latents.T[None], core_frames=core_frames, halo_frames=halo_frames,
                                            on_progress=progress, cancelled=cancelled)[0]
        if not torch.isfinite(audio).all():
            raise FloatingPointError("the VAE produced non-finite audio")
        return audio.clamp(-1, 1).T.contiguous().numpy()
