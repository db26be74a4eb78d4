"""Quality gate: how far a candidate AR (another precision or engine) moves YuE2's next-token distribution.

Every position of the reference model's own sampled held-out sequences is teacher-forced
through the reference and the candidate, and compared per phase (abc, semantic):
top-1 agreement, NLL of the sampled token (reference / candidate), total-variation distance
(TV, the share of sampling probability that moved) and KL(reference || candidate) of the
distribution after the phase mask (temperature 1, before top-k/top-p), agreement split by the
reference's confidence (top-1 p > 0.5 or not), and repeated 24-grams in streams the candidate
generates itself. A floor row (bf16 against bf16 by another path) shows the numerical noise.

Sources: `torch:DIR` (a MoT dir; `torch:DIR#int8` or `#fp8` adds load-time proxies; a
`yue2-int8-ar` dir loads as int8) compares exactly over the full vocabulary; `vllm:DIR` (a Qwen3
AR checkpoint, e.g. an FP8 export) gives prompt logprobs for its top-20 ids only, so its rows
compare distributions coarsened to {those ids, the sampled id, the rest}, unmasked (marked in the
`support` column). TV and KL on a coarsening never exceed the true values.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..checkpoint import atomic_directory, write_json_atomic
from ..protocol import Sampling, allowed_token_ids

TOP_K = 20
CHUNK = 512
NGRAM = 24
CONFIDENCE_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0000001)


# --------------------------------------------------------------------------- sources


class TorchSource:
    """Exact logits from our torch MoT (bf16, load-time proxies, or a yue2-int8-ar checkpoint)."""

    support = "full vocab, phase mask"

    def __init__(self, spec: str, model=None):
        from ..model.loader import load_model

        path, _, quant = spec.partition("#")
        self.label = f"torch:{Path(path).name}" + (f"#{quant}" if quant else "")
        self.model = model if model is not None else load_model(path)
        if quant:
            from ..model.torch_quant import prepare_ar_proxies

            prepare_ar_proxies(self.model, quant, reference=True)  # FP8 off-GPU: the dequantising reference

    def dense_logits(self, tokens: np.ndarray, chunk: int = CHUNK) -> Iterator[tuple[int, torch.Tensor]]:
        """`(start, logits[n, vocab])`: row j predicts token start + j + 1."""
        ids = torch.as_tensor(tokens, dtype=torch.long)[None]
        cache = self.model.new_cache(len(tokens))
        for start in range(0, len(tokens) - 1, chunk):
            end = min(start + chunk, len(tokens) - 1)
            yield start, self.model.forward_ar(ids[:, start:end], cache, logits_to_keep=0)[0].float()

    def stream(self, prefix: list[int], sampling: Sampling, seed: int) -> list[int]:
        from ..model.sampling import TorchARBackend

        return TorchARBackend(self.model).generate(prefix, sampling, seed, "semantic").ids


class VLLMSource:
    """Top-20 prompt logprobs from an in-process vLLM engine on a Qwen3 AR checkpoint."""

    support = f"top-{TOP_K} partition, unmasked"

    def __init__(self, spec: str, max_model_len: int = 24576, kv_cache_dtype: str = "auto"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from ..kv_cache import explicit

        path = spec.split(":", 1)[-1] if spec.startswith("vllm:") else spec
        self.label = f"vllm:{Path(path).name[:24]}" + (f"#kv={kv_cache_dtype}" if kv_cache_dtype != "auto" else "")
        self.llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len,
                       enforce_eager=True, max_logprobs=TOP_K, kv_cache_memory_bytes=256 * 2**20, seed=0,
                       enable_prefix_caching=False, **explicit(kv_cache_dtype))

    def sparse_logprobs(self, tokens: np.ndarray) -> list[dict[int, float] | None]:
        """Per position i: logprobs (full-vocab normalised) of the top ids and of token i, given tokens < i."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=TOP_K, detokenize=False)
        output = self.llm.generate([{"prompt_token_ids": [int(t) for t in tokens]}], params, use_tqdm=False)[0]
        return [None if entry is None else {int(k): float(v.logprob) for k, v in entry.items()}
                for entry in output.prompt_logprobs]

    def stream(self, prefix: list[int], sampling: Sampling, seed: int, phase: str = "semantic") -> list[int]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                min_tokens=sampling.min_tokens, max_tokens=sampling.max_tokens, seed=seed,
                                detokenize=False, allowed_token_ids=allowed_token_ids(phase),
                                extra_args={"yue2_window_penalty": sampling.repetition_penalty,
                                            "yue2_penalty_window": sampling.penalty_window})
        ids = list(self.llm.generate([{"prompt_token_ids": prefix}], params, use_tqdm=False)[0].outputs[0].token_ids)
        return ids

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def open_source(spec: str, *, max_model_len: int = 24576):
    if spec.startswith("vllm:"):
        return VLLMSource(spec, max_model_len)
    return TorchSource(spec.split(":", 1)[1] if spec.startswith("torch:") else spec)


# --------------------------------------------------------------------------- statistics


@dataclass
class PhaseStats:
    positions: int = 0
    agree: int = 0
    nll_reference: float = 0.0
    nll_candidate: float = 0.0
    tv: float = 0.0
    kl: float = 0.0
    bucket_total: list[int] = field(default_factory=lambda: [0] * (len(CONFIDENCE_EDGES) - 1))
    bucket_agree: list[int] = field(default_factory=lambda: [0] * (len(CONFIDENCE_EDGES) - 1))
    tv_trace: list[float] = field(default_factory=list)

    def add(self, agree: torch.Tensor, nll_ref: torch.Tensor, nll_cand: torch.Tensor, tv: torch.Tensor,
            kl: torch.Tensor, confidence: torch.Tensor) -> None:
        self.positions += len(agree)
        self.agree += int(agree.sum())
        self.nll_reference += float(nll_ref.sum())
        self.nll_candidate += float(nll_cand.sum())
        self.tv += float(tv.sum())
        self.kl += float(kl.sum())
        self.tv_trace.extend(tv.tolist())
        buckets = torch.bucketize(confidence, torch.tensor(CONFIDENCE_EDGES[1:-1]), right=True)
        for b in range(len(self.bucket_total)):
            chosen = buckets == b
            self.bucket_total[b] += int(chosen.sum())
            self.bucket_agree[b] += int((agree & chosen).sum())

    def row(self) -> dict:
        n = max(self.positions, 1)
        high = sum(self.bucket_total[2:]), sum(self.bucket_agree[2:])
        low = sum(self.bucket_total[:2]), sum(self.bucket_agree[:2])
        return {"positions": self.positions, "top1": self.agree / n, "nll_reference": self.nll_reference / n,
                "nll_candidate": self.nll_candidate / n, "tv": self.tv / n, "kl": self.kl / n,
                "top1_confident": high[1] / high[0] if high[0] else None,
                "top1_unsure": low[1] / low[0] if low[0] else None,
                "agreement_by_confidence": [a / t if t else None for a, t in zip(self.bucket_agree, self.bucket_total)]}


def _phase_columns(phase: str) -> tuple[torch.Tensor, torch.Tensor]:
    columns = torch.tensor(allowed_token_ids(phase))
    lookup = torch.full((int(columns.max()) + 1,), -1, dtype=torch.long)
    lookup[columns] = torch.arange(len(columns))
    return columns, lookup


def compare_dense(stats: PhaseStats, reference: torch.Tensor, candidate: torch.Tensor, targets: torch.Tensor,
                  phase: str) -> None:
    """Exact comparison over the phase's allowed ids (rows = positions predicting `targets`)."""
    columns, lookup = _phase_columns(phase)
    log_p = torch.log_softmax(reference[:, columns], -1)
    log_q = torch.log_softmax(candidate[:, columns], -1)
    target_cols = lookup[targets]
    p = log_p.exp()
    picked = torch.arange(len(targets))
    stats.add(agree=log_p.argmax(-1) == log_q.argmax(-1), nll_ref=-log_p[picked, target_cols],
              nll_cand=-log_q[picked, target_cols], tv=0.5 * (p - log_q.exp()).abs().sum(-1),
              kl=(p * (log_p - log_q)).sum(-1), confidence=p.max(-1).values)


def compare_sparse(stats: PhaseStats, reference: torch.Tensor, candidate: list[dict[int, float]],
                   targets: torch.Tensor) -> None:
    """Coarsened comparison: each row's partition is {candidate's top ids, the target, everything else}."""
    log_p_full = torch.log_softmax(reference, -1)
    agree, nll_r, nll_c, tvs, kls, conf = [], [], [], [], [], []
    for row, entry, target in zip(log_p_full, candidate, targets.tolist()):
        ids = torch.tensor(sorted(set(entry) | {target}))
        p = row[ids].exp()
        q = torch.tensor([np.exp(entry.get(int(i), -np.inf)) for i in ids], dtype=torch.float32)
        p_all = torch.cat([p, (1 - p.sum()).clamp(min=0)[None]])
        q_all = torch.cat([q, (1 - q.sum()).clamp(min=0)[None]])
        mask = p_all > 0
        kls.append(float((p_all[mask] * (p_all[mask].log() - q_all[mask].clamp(min=1e-30).log())).sum()))
        tvs.append(float(0.5 * (p_all - q_all).abs().sum()))
        agree.append(int(row.argmax()) == max(entry, key=entry.get))
        nll_r.append(float(-row[target]))
        nll_c.append(-entry.get(target, float("nan")))
        conf.append(float(row.max().exp()))
    stats.add(torch.tensor(agree), torch.tensor(nll_r), torch.tensor(nll_c), torch.tensor(tvs), torch.tensor(kls),
              torch.tensor(conf))


def repeated_ngrams(tokens: list[int], n: int = NGRAM) -> int:
    """How many n-gram occurrences repeat an earlier one (0 for a stream without loops)."""
    seen, repeats = set(), 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats


# --------------------------------------------------------------------------- the gate


def evaluate_pair(reference: TorchSource, candidate, sequences, generation: dict | None = None) -> dict:
    """One table row per phase for `candidate` against `reference` over the held-out sequences."""
    stats = {"abc": PhaseStats(), "semantic": PhaseStats()}
    repeats, streamed = 0, 0
    semantic_sampling = Sampling(**(generation or {}).get("semantic", {})) if generation else Sampling()
    for record, tokens in sequences:
        targets_of = {phase: range(*span) for phase, span in record["targets"].items()}
        sparse = candidate.sparse_logprobs(tokens) if isinstance(candidate, VLLMSource) else None
        dense_candidate = None if sparse is not None else candidate.dense_logits(tokens)
        for start, ref_logits in reference.dense_logits(tokens):
            cand_logits = next(dense_candidate)[1] if dense_candidate is not None else None
            positions = torch.arange(start, start + len(ref_logits))  # row j predicts token j + 1
            for phase, span in targets_of.items():
                keep = (positions + 1 >= span.start) & (positions + 1 < span.stop)
                if not keep.any():
                    continue
                rows = keep.nonzero().flatten()
                targets = torch.as_tensor(tokens[(positions[rows] + 1).numpy()], dtype=torch.long)
                if sparse is None:
                    compare_dense(stats[phase], ref_logits[rows], cand_logits[rows], targets, phase)
                else:
                    entries = [sparse[int(p) + 1] for p in positions[rows]]
                    compare_sparse(stats[phase], ref_logits[rows], entries, targets)
        prefix = [int(t) for t in tokens[:record["targets"]["semantic"][0]]]
        stream = candidate.stream(prefix, semantic_sampling, record["seed"])
        repeats += repeated_ngrams(stream)
        streamed += len(stream)
    return {"candidate": candidate.label, "support": candidate.support,
            "phases": {phase: s.row() for phase, s in stats.items() if s.positions},
            "repeated_24grams": repeats, "streamed_tokens": streamed,
            "tv_trace": {phase: s.tv_trace for phase, s in stats.items() if s.positions}}


class ChunkedTorchSource(TorchSource):
    """The same bf16 model through a different path (64-token chunks): the numerical floor."""

    def __init__(self, base: TorchSource):
        self.model, self.label = base.model, f"{base.label} (64-token chunks)"

    def dense_logits(self, tokens, chunk: int = CHUNK):
        # Recompute in 64-token pieces and regroup to the reference's chunk boundaries.
        pieces = list(super().dense_logits(tokens, 64))
        logits = torch.cat([p for _, p in pieces])
        for start in range(0, len(tokens) - 1, chunk):
            yield start, logits[start:start + chunk]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| candidate | support | phase | positions | top-1 | top-1 (p>0.5) | top-1 (p≤0.5) | NLL ref / cand | "
             "TV | KL | repeated 24-grams |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]

    def fmt(value, spec=".3f"):
        return "–" if value is None else format(value, spec)

    for row in rows:
        for phase, m in row["phases"].items():
            lines.append(f"| {row['candidate']} | {row['support']} | {phase} | {m['positions']} | {fmt(m['top1'])} | "
                         f"{fmt(m['top1_confident'])} | {fmt(m['top1_unsure'])} | "
                         f"{fmt(m['nll_reference'])} / {fmt(m['nll_candidate'])} | {fmt(100 * m['tv'], '.2f')}% | "
                         f"{fmt(m['kl'], '.4f')} | {row['repeated_24grams']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for phase in ("semantic", "abc"):
        traced = [r for r in rows if phase in r["tv_trace"]]
        if not traced:
            continue
        figure, axis = plt.subplots(figsize=(8, 3.5))
        for row in traced:
            trace = np.asarray(row["tv_trace"][phase])
            width = max(1, len(trace) // 100)
            smooth = np.convolve(trace, np.ones(width) / width, mode="valid")
            axis.plot(smooth, label=row["candidate"], linewidth=1)
        axis.set(xlabel="held-out position", ylabel="TV distance", title=f"TV per position ({phase} phase)")
        axis.legend(fontsize=7)
        figure.tight_layout()
        name = f"tv_{phase}.png"
        figure.savefig(out_dir / name, dpi=110)
        plt.close(figure)
        written.append(name)
    figure, axis = plt.subplots(figsize=(8, 3.5))
    labels = [f"{a:.2f}–{min(b, 1):.2f}" for a, b in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:])]
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        values = [v if v is not None else 0 for v in row["phases"].get("semantic", next(iter(row["phases"].values())))
                  ["agreement_by_confidence"]]
        axis.bar(np.arange(len(labels)) + i * width, values, width, label=row["candidate"])
    axis.set(xticks=np.arange(len(labels)) + 0.4 - width / 2, xticklabels=labels, ylim=(0, 1.05),
             xlabel="reference top-1 probability", ylabel="top-1 agreement", title="Agreement by confidence")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out_dir / "agreement_by_confidence.png", dpi=110)
    plt.close(figure)
    return written + ["agreement_by_confidence.png"]


def run_gate(reference_spec: str, candidate_specs: list[str], corpus_dir: str | os.PathLike,
             out_dir: str | os.PathLike, *, floor: bool = True) -> dict:
    """Evaluate each candidate against the reference; write `quality.md`, `quality.json` and PNG plots."""
    from .calibration import heldout_sequences, load_manifest

    sequences = heldout_sequences(corpus_dir)
    if not sequences:
        raise ValueError(f"{corpus_dir}: the corpus has no held-out requests")
    generation = load_manifest(corpus_dir).get("generation")
    longest = max(len(tokens) for _, tokens in sequences) + (generation or {}).get("semantic", {}).get(
        "max_tokens", 9000)
    reference = open_source(reference_spec)
    rows = [evaluate_pair(reference, ChunkedTorchSource(reference), sequences, generation)] if floor else []
    for spec in candidate_specs:  # one engine at a time: in-process vLLM engines share global state
        candidate = open_source(spec, max_model_len=min(24576, longest + 16))
        try:
            rows.append(evaluate_pair(reference, candidate, sequences, generation))
        finally:
            if hasattr(candidate, "close"):
                candidate.close()
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        (tmp / "quality.md").write_text(markdown_table(rows), encoding="utf-8")
        plots = plot(rows, tmp)
        report = {"reference": reference.label, "corpus": str(corpus_dir), "sequences": [r["id"] for r, _ in sequences],
                  "rows": [{k: v for k, v in row.items() if k != "tv_trace"} for row in rows], "plots": plots}
        write_json_atomic(tmp / "quality.json", report)
    return report
