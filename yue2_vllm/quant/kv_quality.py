"""The FP8 KV cache's quality row: the same AR checkpoint on vLLM with bf16 K/V (the reference) and with an FP8
KV cache (the candidate), compared per phase (abc, semantic) on the corpus's held-out sequences.

Teacher forcing: each held-out sequence is prefilled through both engines (vLLM's attention reads the prompt's
K/V back from the cache, so the prefill sees the FP8 K/V) and the top-20 prompt logprobs are compared at every
position a phase generated: top-1 agreement, NLL of the sampled token, and TV and KL(bf16 KV || FP8 KV) of
the distributions coarsened to {the ids both engines report, the sampled id, the rest} (lower bounds of the
true values, as in evaluate.py). Sampling: each phase is sampled again from its held-out prompt under the
same seeds on both engines, and the histograms of the sampled ids are compared by TV; the floor is the bf16
engine against itself under other seeds (the sampling noise of that many tokens).
"""
from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import torch

from ..checkpoint import atomic_directory, write_json_atomic
from ..protocol import Sampling
from .evaluate import TOP_K, PhaseStats, VLLMSource

FLOOR_SEED_OFFSET = 1000  # the floor's streams: the same prompts under seeds this far from the reference's
SAMPLES = 2  # streams per held-out prompt and phase (seeds record seed + k)


def ar_checkpoint_of(spec: str) -> Path:
    """The AR checkpoint a KV row serves: `vllm:DIR` (a Qwen3 AR checkpoint) as it is, `torch:DIR` or a MoT
    directory derived (derive.derive_ar_checkpoint, cached by content)."""
    if spec.startswith("vllm:"):
        return Path(spec.split(":", 1)[1])
    from ..derive import derive_ar_checkpoint

    return Path(derive_ar_checkpoint(Path(spec.split(":", 1)[1] if spec.startswith("torch:") else spec)))


def compare_sparse_pair(stats: PhaseStats, reference: list[dict[int, float]], candidate: list[dict[int, float]],
                        targets: list[int]) -> None:
    """Both engines' top-k logprobs, coarsened alike: {ids both report, the target, everything else}."""
    agree, nll_r, nll_c, tvs, kls, conf = [], [], [], [], [], []
    for ref, cand, target in zip(reference, candidate, targets):
        ids = sorted((set(ref) & set(cand)) | {target})
        p = torch.tensor([ref.get(i, float("-inf")) for i in ids], dtype=torch.float64).exp()
        q = torch.tensor([cand.get(i, float("-inf")) for i in ids], dtype=torch.float64).exp()
        p = torch.cat([p, (1 - p.sum()).clamp(min=0)[None]])
        q = torch.cat([q, (1 - q.sum()).clamp(min=0)[None]])
        mask = p > 0
        kls.append(float((p[mask] * (p[mask].log() - q[mask].clamp(min=1e-30).log())).sum()))
        tvs.append(float(0.5 * (p - q).abs().sum()))
        agree.append(max(ref, key=ref.get) == max(cand, key=cand.get))
        nll_r.append(-ref.get(target, float("nan")))
        nll_c.append(-cand.get(target, float("nan")))
        conf.append(math.exp(max(ref.values())))
    stats.add(torch.tensor(agree), torch.tensor(nll_r), torch.tensor(nll_c), torch.tensor(tvs), torch.tensor(kls),
              torch.tensor(conf))


def histogram_tv(a: list[int], b: list[int]) -> float:
    """Total-variation distance between the histograms of two token streams (0: same ids equally often)."""
    if not a or not b:
        return 0.0 if not a and not b else 1.0
    ca, cb = Counter(a), Counter(b)
    return 0.5 * sum(abs(ca[t] / len(a) - cb[t] / len(b)) for t in set(ca) | set(cb))


def phase_sampling(generation: dict | None, phase: str, span: tuple[int, int]) -> Sampling:
    """The corpus's sampling for `phase`, bounded by what the held-out sequence generated there."""
    fields = dict((generation or {}).get(phase, {}))
    fields["max_tokens"] = max(1, span[1] - span[0])
    fields["min_tokens"] = min(fields.get("min_tokens", 0), fields["max_tokens"])
    return Sampling(**fields)


def engine_pass(source, sequences, generation: dict | None, seed_offset: int = 0, logprobs: bool = True,
                samples: int = SAMPLES) -> dict:
    """One engine over the held-out sequences: per sequence its prompt logprobs, and per phase the ids it
    samples from that phase's prompt (`samples` streams, seeds record seed + offset + k)."""
    out = {"logprobs": [], "sampled": {"abc": [], "semantic": []}}
    for record, tokens in sequences:
        if logprobs:
            out["logprobs"].append(source.sparse_logprobs(tokens))
        for phase, span in record["targets"].items():
            prefix = [int(t) for t in tokens[:span[0]]]
            sampling = phase_sampling(generation, phase, tuple(span))
            for k in range(samples):
                out["sampled"][phase] += source.stream(prefix, sampling, record["seed"] + seed_offset + k, phase)
    return out


def kv_row(reference: dict, candidate: dict, floor: dict, sequences, label: str) -> dict:
    """The comparison table's row for one KV form, per phase."""
    stats = {"abc": PhaseStats(), "semantic": PhaseStats()}
    for index, (record, tokens) in enumerate(sequences):
        ref, cand = reference["logprobs"][index], candidate["logprobs"][index]
        for phase, (start, stop) in record["targets"].items():
            positions = range(max(start, 1), stop)  # entry i: token i given tokens < i
            compare_sparse_pair(stats[phase], [ref[i] for i in positions], [cand[i] for i in positions],
                                [int(tokens[i]) for i in positions])
    phases = {}
    for phase, s in stats.items():
        if not s.positions:
            continue
        row = s.row()
        row.update(sampled_tokens=len(candidate["sampled"][phase]),
                   sampled_tv=histogram_tv(reference["sampled"][phase], candidate["sampled"][phase]),
                   sampled_tv_floor=histogram_tv(reference["sampled"][phase], floor["sampled"][phase]))
        phases[phase] = row
    return {"candidate": label, "support": f"top-{TOP_K} both engines", "phases": phases}


def kv_markdown(rows: list[dict]) -> str:
    lines = ["| KV cache | phase | positions | top-1 | NLL bf16 KV / this | TV | KL | sampled tokens | "
             "sampled-histogram TV (floor) |", "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for row in rows:
        for phase, m in row["phases"].items():
            lines.append(f"| {row['candidate']} | {phase} | {m['positions']} | {m['top1']:.3f} | "
                         f"{m['nll_reference']:.3f} / {m['nll_candidate']:.3f} | {100 * m['tv']:.3f}% | "
                         f"{m['kl']:.2e} | {m['sampled_tokens']} | {100 * m['sampled_tv']:.1f}% "
                         f"({100 * m['sampled_tv_floor']:.1f}%) |")
    return "\n".join(lines) + "\n"


def run_kv_gate(reference_spec: str, corpus_dir: str | os.PathLike, out_dir: str | os.PathLike,
                forms: tuple[str, ...] = ("fp8",), samples: int = SAMPLES) -> dict:
    """FP8 KV against bf16 KV on one AR checkpoint; writes `kv_quality.md` and `kv_quality.json` to `out_dir`.
    Engines run one at a time (in-process vLLM engines share global state)."""
    from ..kv_cache import check_form, is_fp8
    from .calibration import heldout_sequences, load_manifest

    for form in forms:
        if not is_fp8(check_form(form)):
            raise ValueError(f"--kv-cache-dtype {form}: the KV row compares an FP8 form against bf16 K/V")
    sequences = heldout_sequences(corpus_dir)
    if not sequences:
        raise ValueError(f"{corpus_dir}: the corpus has no held-out requests")
    generation = load_manifest(corpus_dir).get("generation")
    longest = max(len(tokens) for _, tokens in sequences) + 16
    checkpoint = ar_checkpoint_of(reference_spec)

    def run(form: str, **options) -> tuple[dict, str]:
        source = VLLMSource(f"vllm:{checkpoint}", max_model_len=min(24576, longest), kv_cache_dtype=form)
        try:
            return engine_pass(source, sequences, generation, samples=samples, **options), source.label
        finally:
            source.close()

    reference, label = run("auto")
    floor, _ = run("auto", seed_offset=FLOOR_SEED_OFFSET, logprobs=False)
    rows = [kv_row(reference, reference, floor, sequences, f"{label} (bf16 KV against itself)")]
    for form in forms:
        candidate, candidate_label = run(form)
        rows.append(kv_row(reference, candidate, floor, sequences, candidate_label))
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        (tmp / "kv_quality.md").write_text(kv_markdown(rows), encoding="utf-8")
        report = {"reference": label, "checkpoint": str(checkpoint), "corpus": str(corpus_dir),
                  "sequences": [r["id"] for r, _ in sequences], "samples": samples,
                  "rows": rows}
        write_json_atomic(tmp / "kv_quality.json", report)
    return report
