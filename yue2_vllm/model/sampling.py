"""Token sampling for the AR half, and the torch AR backend.

The per-step logits pipeline reproduces upstream's torch path operation for operation, so
the same seed and torch version give the same tokens: fp32 cast (bf16 kept for cot=off's
"legacy" sampling), phase allow-mask, end token blocked below `min_tokens`, count-based
windowed repetition penalty, temperature, top-k (ties kept), top-p (keep ≥ 1, or 3 for
legacy), softmax and a seeded multinomial. Paired CFG mixes the two branches' bf16 logits.

`TorchARBackend` decodes eagerly (one forward per branch and token: upstream's torch-eager, the
CPU/MPS default) or, on CUDA by default, through `decode_step.BranchDecoder`: both CFG branches as
one batch, one captured graph step per token, sampled by `RowSampler` on the phase's rows.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from .decode_step import BranchDecoder, PhaseRows, graph_refusal
from .modeling import YuE2Model
from ..options import TORCH_EXECUTIONS as EXECUTIONS
from ..protocol import CODEC_OFFSET, CODEC_SIZE, EOD, Sampling, ar_signals, check_budget, end_token

OnToken = Callable[[str, int], None]
Cancelled = Callable[[], bool]
LOG = logging.getLogger(__name__)


class ARResult(NamedTuple):
    """Generated content ids (end token excluded), a timing record, and whether `max_tokens` cut it."""

    ids: list[int]
    timing: dict
    truncated: bool


class ARBackend(Protocol):
    """What the pipeline asks of an AR engine, per phase."""

    name: str

    def generate(self, prefix: Sequence[int], sampling: Sampling, seed: int, phase: str, *,
                 negative: Sequence[int] | None = None, cfg_scale: float = 1.0, legacy_off: bool = False,
                 on_token: OnToken | None = None, cancelled: Cancelled | None = None) -> ARResult: ...


# --------------------------------------------------------------------------- logits pipeline


def window_penalty(scores: torch.Tensor, recent: Sequence[int], penalty: float) -> torch.Tensor:
    """Count-based penalty: a token seen c times in `recent` gets α = penalty**c; negative ×α, else ÷α."""
    if penalty == 1.0 or len(recent) == 0:
        return scores
    ids = torch.as_tensor(list(recent), dtype=torch.long, device=scores.device).reshape(1, -1)
    counts = torch.zeros_like(scores)
    counts.scatter_add_(-1, ids, torch.ones_like(ids, dtype=scores.dtype))
    alpha = penalty ** counts
    return torch.where(scores < 0, scores * alpha, scores / alpha)


def phase_scores(logits: torch.Tensor, sampling: Sampling, history: Sequence[int], step: int, phase: str,
                 legacy_off: bool = False) -> torch.Tensor:
    """Scores `[1, vocab]` ready for softmax (or argmax when temperature is 0)."""
    scores = logits.clone() if legacy_off else logits.float().clone()
    end = end_token(phase)
    allowed = torch.full_like(scores, float("-inf"))
    if phase == "abc":
        allowed[..., :EOD] = 0
    else:
        allowed[..., CODEC_OFFSET:CODEC_OFFSET + CODEC_SIZE] = 0
    allowed[..., end] = 0
    scores = scores + allowed
    if step < sampling.min_tokens:
        scores[..., end] = -torch.inf
    scores = window_penalty(scores, history[-sampling.penalty_window:], sampling.repetition_penalty)
    return filtered_scores(scores, sampling, legacy_off)


def filtered_scores(scores: torch.Tensor, sampling: Sampling, legacy_off: bool = False) -> torch.Tensor:
    """The tail of `phase_scores` on penalised scores: temperature, top-k (ties kept), top-p."""
    if sampling.temperature == 0:
        return scores
    if sampling.temperature != 1:
        scores = scores / sampling.temperature
    threshold = scores.topk(min(sampling.top_k, scores.shape[-1])).values[..., -1, None]
    scores = scores.masked_fill(scores < threshold, -torch.inf)
    if sampling.top_p < 1:
        values, indices = scores.sort(descending=True)
        probabilities = values.softmax(-1)
        removed = probabilities.cumsum(-1) - probabilities > sampling.top_p
        removed[..., :3 if legacy_off else 1] = False
        values = values.masked_fill(removed, -torch.inf)
        scores = values.scatter(-1, indices, values)
    return scores


def sample(scores: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """Next id `[1, 1]`: argmax at temperature 0, else a seeded multinomial draw."""
    if temperature == 0:
        return scores.argmax(-1, keepdim=True)
    probabilities = scores.softmax(-1)
    if probabilities.device.type not in ("cpu", "cuda"):  # e.g. MPS: draw on the CPU generator
        return torch.multinomial(probabilities.cpu(), 1, generator=generator).to(probabilities.device)
    return torch.multinomial(probabilities, 1, generator=generator)


def draw(probabilities: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One seeded draw `[1, 1]` from `[1, vocab]` probabilities without a host sync.

    `torch.multinomial(p, 1)` draws as `argmax(p / Exponential(1))` with one exponential per entry (the
    same generator advance), after checking `p` with two host syncs; this is that draw without the checks
    (`phase_scores` never yields a negative, NaN or all-zero row).
    """
    if probabilities.device.type not in ("cpu", "cuda"):  # e.g. MPS: the CPU generator, as `sample` does
        return torch.multinomial(probabilities.cpu(), 1, generator=generator).to(probabilities.device)
    noise = torch.empty_like(probabilities).exponential_(1, generator=generator)
    return (probabilities / noise).argmax(-1, keepdim=True)


def mix_cfg(conditional: torch.Tensor, unconditional: torch.Tensor | None, cfg_scale: float) -> torch.Tensor:
    """`uncond + cfg·(cond − uncond)` in the logits' own dtype (bf16), before any upcast."""
    if cfg_scale == 1.0 or unconditional is None:
        return conditional
    return unconditional + cfg_scale * (conditional - unconditional)


# --------------------------------------------------------------------------- the phase's rows on the device


class RowSampler:
    """`phase_scores` + `sample` for the batched decode: scores on the phase's own rows, the penalty window
    counted on the device (no host list per token).

    Same arithmetic as `phase_scores` on the allowed ids (the allow-mask adds 0 there; only ties at the
    top-p cut may sort differently); the scores are scattered into a full-vocabulary row of -inf before the
    softmax, so the softmax and the seeded draw see what the two-forward path's `sample` sees and the
    generator advances identically (`draw` is `torch.multinomial`'s one-sample draw without its host syncs).
    """

    def __init__(self, rows: PhaseRows, sampling: Sampling, phase: str, vocab_size: int, device: torch.device,
                 legacy_off: bool = False):
        self.sampling, self.legacy_off, self.vocab_size = sampling, legacy_off, vocab_size
        self.row_ids = rows.ids(device)
        self.end_index = rows.index_of(end_token(phase))
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.window = torch.zeros(sampling.max_tokens, dtype=torch.long, device=device)
        self.one = torch.ones(1, dtype=torch.float32, device=device)

    def scores(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Scores `[1, rows]` of the mixed row logits at `step` (tokens already generated)."""
        sampling = self.sampling
        scores = logits.clone() if self.legacy_off else logits.float().clone()
        if step < sampling.min_tokens:
            scores[..., self.end_index] = -torch.inf
        if sampling.repetition_penalty != 1.0 and step > 0:
            alpha = sampling.repetition_penalty ** self.counts.index_select(0, self.row_ids).to(scores.dtype)[None]
            scores = torch.where(scores < 0, scores * alpha, scores / alpha)
        return filtered_scores(scores, sampling, self.legacy_off)

    def sample(self, logits: torch.Tensor, step: int, generator: torch.Generator) -> torch.Tensor:
        """The next vocabulary id `[1, 1]` (on the device), counted into the penalty window."""
        scores = self.scores(logits, step)
        full = torch.full((1, self.vocab_size), -torch.inf, dtype=scores.dtype, device=scores.device)
        full.index_copy_(1, self.row_ids, scores)
        next_id = full.argmax(-1, keepdim=True) if self.sampling.temperature == 0 else draw(full.softmax(-1), generator)
        self._count(next_id.view(1), step)
        return next_id

    def _count(self, token: torch.Tensor, step: int) -> None:
        self.window[step:step + 1] = token
        self.counts.index_add_(0, token, self.one)
        leaving = step - self.sampling.penalty_window
        if leaving >= 0:
            self.counts.index_add_(0, self.window[leaving:leaving + 1], -self.one)


# --------------------------------------------------------------------------- torch backend


def resolve_execution(requested: str, device: torch.device) -> tuple[str, str | None]:
    """`(execution, reason)` for `--torch-execution`: "cuda_graph" (reason None), "eager" or "batched" with why.

    auto: a captured step on CUDA, eager elsewhere; graph: the same, but a non-CUDA device is refused;
    eager: the two-forward path; batched: the capture-ready batched step run eagerly (a diagnostic).
    """
    if requested not in EXECUTIONS:
        raise ValueError(f"torch execution must be one of {EXECUTIONS}, got {requested!r}")
    device = torch.device(device)
    if requested == "eager":
        return "eager", "eager requested (--torch-execution eager)"
    if requested == "batched":
        return "batched", "capture-free batched step requested (--torch-execution batched)"
    if device.type != "cuda":
        if requested == "graph":
            raise ValueError(f"--torch-execution graph needs a CUDA device; the model is on {device} "
                             "(CPU and MPS decode eagerly)")
        return "eager", (f"non_cuda_device: CUDA graphs are captured on CUDA only; {device.type} decodes eagerly "
                         "(on the CPU bit-exact with upstream's torch-eager)")
    if getattr(torch.version, "hip", None):
        if requested == "graph":
            raise ValueError("--torch-execution graph is not validated on ROCm (its varlen attention rejects "
                             "seqused_k); use auto or eager")
        return "eager", "rocm_not_graph_validated: ROCm decodes eagerly"
    return "cuda_graph", None


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """A phase's generator, fresh and seeded: on the model's device, the CPU for MPS (as upstream)."""
    return torch.Generator(device=device if device.type in ("cpu", "cuda") else "cpu").manual_seed(seed)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _HostToken:
    """The sampled id on its way to the host: on CUDA an async copy into pinned memory plus an event, so the
    next step can be launched before the host waits for the token (the one sync streaming needs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buffer = torch.empty(1, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending: torch.Tensor | None = None

    def send(self, token: torch.Tensor) -> None:
        if self.cuda:
            self.buffer.copy_(token.view(1), non_blocking=True)
            self.event.record()
        else:
            self.pending = token

    def receive(self) -> int:
        if self.cuda:
            self.event.synchronize()
            return int(self.buffer[0])
        return int(self.pending.item())


class TorchARBackend:
    """AR decoding on the MoT's AR expert: a captured batched step on CUDA, eager static-cache decoding elsewhere.

    `execution` is `--torch-execution` (see `resolve_execution`). A capture that fails, or AR linears
    `graph_refusal` declines, make that phase eager; each phase records `execution`, `attention` and
    `graph_fallback_reason`.
    """

    name = "torch"

    def __init__(self, model: YuE2Model, execution: str = "auto"):
        self.model = model
        self.execution_requested = execution
        self.execution, self.execution_reason = resolve_execution(execution, model.device)

    @torch.inference_mode()
    def generate(self, prefix: Sequence[int], sampling: Sampling, seed: int, phase: str, *,
                 negative: Sequence[int] | None = None, cfg_scale: float = 1.0, legacy_off: bool = False,
                 on_token: OnToken | None = None, cancelled: Cancelled | None = None) -> ARResult:
        check_budget(prefix, sampling.max_tokens, f"{phase} prompt")
        if cfg_scale != 1.0:
            if negative is None:
                raise ValueError("cfg_scale != 1 needs a negative (unconditional) prompt")
            check_budget(negative, sampling.max_tokens, f"{phase} negative prompt")
        if cancelled is not None and cancelled():
            raise InterruptedError(f"cancelled before the {phase} prefill")
        branches = [list(prefix)] + ([list(negative)] if cfg_scale != 1.0 else [])
        run = _Phase(branches, sampling, seed, phase, cfg_scale, legacy_off, on_token, cancelled)
        execution, reason = self.execution, self.execution_reason
        if execution == "cuda_graph":
            reason = graph_refusal(self.model)
            if reason is not None:
                execution = "eager"
        if execution == "eager":
            return self._eager(run, reason)
        try:
            return self._batched(run, capture=execution == "cuda_graph", reason=reason)
        except _CaptureFailed as exc:
            LOG.warning("%s phase: CUDA graph capture failed, decoding eagerly: %s", phase, exc)
            return self._eager(run, f"capture_failed: {exc}")

    def _eager(self, run: "_Phase", reason: str | None) -> ARResult:
        """The two-forward path: one static cache and one forward per branch and token."""
        model, device, sampling, phase = self.model, self.model.device, run.sampling, run.phase
        generator = seeded_generator(device, run.seed)
        caches = [model.new_cache(len(ids) + sampling.max_tokens) for ids in run.branches]

        _synchronize(device)
        start = time.perf_counter()
        logits = [model.forward_ar(torch.tensor([ids], device=device), cache)[:, -1, :]
                  for ids, cache in zip(run.branches, caches)]
        _synchronize(device)
        prefill_seconds = time.perf_counter() - start
        state = {"logits": logits}
        row_ids = PhaseRows.for_phase(phase).ids(device)

        def pick(step: int, history: list[int]) -> int:
            if step:
                state["logits"] = [model.forward_ar(state["next_id"], cache)[:, -1, :] for cache in caches]
            logits = state["logits"]
            mixed = mix_cfg(logits[0], logits[1] if len(logits) > 1 else None, run.cfg_scale)
            state["next_id"] = sample(phase_scores(mixed, sampling, history, step, phase, run.legacy_off),
                                      sampling.temperature, generator)
            token = int(state["next_id"].item())
            cond = logits[0][0].float()
            run.logprob(cond[token] - torch.logsumexp(cond.index_select(0, row_ids), 0))
            return token

        history, first_token_seconds, ended = run.decode(start, pick)
        _synchronize(device)
        timing = run.timing(time.perf_counter() - start, prefill_seconds, first_token_seconds, len(history), ended)
        timing.update(execution="eager", attention="sdpa", graph_fallback_reason=reason)
        return ARResult(history, timing, not ended)

    def _batched(self, run: "_Phase", *, capture: bool, reason: str | None) -> ARResult:
        """Both branches as one batch through `BranchDecoder` (captured on CUDA when `capture`)."""
        model, device, sampling, phase = self.model, self.model.device, run.sampling, run.phase
        rows = PhaseRows.for_phase(phase)
        generator = seeded_generator(device, run.seed)
        sampler = RowSampler(rows, sampling, phase, model.config.vocab_size, device, run.legacy_off)
        host = _HostToken(device)
        _synchronize(device)
        start = time.perf_counter()
        decoder = BranchDecoder(model, run.branches, sampling.max_tokens, rows=rows, capture=capture)
        try:
            try:
                logits = decoder.prefill()
            except RuntimeError as exc:  # torch.OutOfMemoryError included
                if not capture:
                    raise
                raise _CaptureFailed(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
            _synchronize(device)
            prefill_seconds = time.perf_counter() - start
            state = {"logits": logits}

            def pick(step: int, history: list[int]) -> int:
                logits = state["logits"]
                mixed = mix_cfg(logits[0:1], logits[1:2] if len(logits) > 1 else None, run.cfg_scale)
                next_id = sampler.sample(mixed, step, generator)
                cond = torch.log_softmax(logits[0].float(), -1)  # before a captured step overwrites the logits
                host.send(next_id)
                if step + 1 < sampling.max_tokens:
                    state["logits"] = decoder.step(next_id)  # queued before the host waits for the token
                token = host.receive()
                run.logprob(cond[rows.index_of(token)])
                return token

            history, first_token_seconds, ended = run.decode(start, pick)
            _synchronize(device)
            timing = run.timing(time.perf_counter() - start, prefill_seconds, first_token_seconds, len(history),
                                ended)
            timing.update(execution="cuda_graph" if decoder.graph is not None else "batched",
                          attention=decoder.attention, graph_fallback_reason=reason,
                          capture_seconds=decoder.capture_seconds, graph_bytes=decoder.graph_bytes,
                          kv_bytes=decoder.kv_bytes)
            return ARResult(history, timing, not ended)
        finally:
            decoder.close()


class _CaptureFailed(RuntimeError):
    pass


@dataclass
class _Phase:
    """One phase's request, as both execution paths read it."""

    branches: list[list[int]]
    sampling: Sampling
    seed: int
    phase: str
    cfg_scale: float
    legacy_off: bool
    on_token: OnToken | None
    cancelled: Cancelled | None
    logprobs: list = field(default_factory=list)  # per sampled token: the cond branch's raw log-prob (device)

    def logprob(self, value: torch.Tensor) -> None:
        self.logprobs.append(value.reshape(()))

    def check_cancelled(self, step: int) -> None:
        if self.cancelled is not None and self.cancelled():
            raise InterruptedError(f"cancelled during the {self.phase} phase after {step} tokens")

    def decode(self, start: float, pick: Callable[[int, list[int]], int]) -> tuple[list[int], float | None, bool]:
        """The token loop of both paths: `pick(step, history)` advances the model and samples one id.
        Returns the content ids, the seconds to the first token, and whether the end token came."""
        end, history, first_token_seconds = end_token(self.phase), [], None
        for step in range(self.sampling.max_tokens):
            self.check_cancelled(step)
            token = pick(step, history)
            if first_token_seconds is None:
                first_token_seconds = time.perf_counter() - start
            if self.on_token is not None:
                self.on_token(self.phase, token)
            if token == end:
                return history, first_token_seconds, True
            history.append(token)
        return history, first_token_seconds, False

    def timing(self, seconds: float, prefill_seconds: float, first_token_seconds: float | None, content: int,
               ended: bool) -> dict:
        output_tokens = content + int(ended)
        return {
            "seconds": seconds, "prefill_seconds": prefill_seconds, "ttft_seconds": first_token_seconds,
            "output_tokens": output_tokens, "content_tokens": content,
            "output_tps": output_tokens / seconds if seconds > 0 else 0.0, "prefix_tokens": len(self.branches[0]),
            "cfg_branches": len(self.branches), "backend_actual": TorchARBackend.name,
            **ar_signals(torch.stack(self.logprobs).double().cpu().tolist() if self.logprobs else [], output_tokens,
                         None, len(self.branches[0])),
        }
