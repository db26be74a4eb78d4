"""Where a decode step's time goes, with the phase-sliced lm_head and with vLLM's own full head, side by side.

One in-process vLLM engine (the V1 runner, our model `YuE2ARForCausalLM` and sampler, as the worker builds it)
decodes `--rows` rows of one phase after a 512-token prompt; `compute_logits` runs our sliced head, the full
head exactly as vLLM's Qwen3 computes it (`mrv2_step.vllm_full_head`: the weight prepacked by vLLM's own CPU
dispatch), or (`--heads ...,plain-slice`) the slice as it ran before issue 48 (a plain `F.linear` on the weight's
rows into a −inf buffer), the heads taking turns step by step, so that the machine's drift falls on all of them
alike (step ms: the median over `--repeats` runs of each head's steps). Then one profiled run per head:
torch.profiler splits its steps into the model's forward, the head (`compute_logits`), the sampler (vLLM's,
with our logits processor) and the rest (scheduler, engine), and lists the ops inside the head.

    python bench/profile_head.py [--model one-layer|DIR] [--dtype bfloat16] [--rows 1,8] [--steps 16]
                                 [--heads sliced,full,plain-slice] [--repeats 3] [--top 6] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("forward", "head", "sampler")
HEADS = ("sliced", "full", "plain-slice")


def plain_slice_logits(model, hidden):
    """The slice as it ran before issue 48: `F.linear` on the phase's rows of the unpacked weight, into −inf."""
    import torch.nn.functional as F

    phases = model._row_phases(len(hidden))
    if phases is None:
        return model.logits_processor(model.lm_head, hidden)
    logits = torch_full_inf(len(hidden), model.config.vocab_size, hidden)
    for phase, index in phases.items():
        low, high = (0, model.config.vocab_size) if phase is None else model.lm_head.quant_method.head.columns(phase)
        logits[index, low:high] = F.linear(hidden[index], model.lm_head.weight[low:high])
    return logits


def torch_full_inf(rows: int, columns: int, like):
    import torch

    return torch.full((rows, columns), float("-inf"), dtype=like.dtype, device=like.device)


def build(checkpoint: Path, dtype: str, max_rows: int):
    from yue2_vllm.engine.plugin import MODEL_ARCHITECTURE, processor_fqcn
    from yue2_vllm.engine.runner import SCHEDULERS
    from yue2_vllm.engine.worker import build_engine

    return build_engine({"model": str(checkpoint), "max_model_len": 2048, "max_num_seqs": max_rows,
                         "max_num_batched_tokens": 2048, "enforce_eager": True, "kv_cache_bytes": 1 << 30,
                         "dtype": dtype, "scheduler_cls": SCHEDULERS[False], "async_scheduling": False,
                         "logits_processors": [processor_fqcn("v1")], "architecture": MODEL_ARCHITECTURE})


@contextmanager
def labelled(mode: dict):
    """The forward, head and sampler under profiler labels; the head sliced or vLLM's own full head per `mode`."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    from yue2_vllm.engine.ar_model import YuE2ARForCausalLM
    from yue2_vllm.engine.mrv2_step import vllm_full_head

    saved = YuE2ARForCausalLM.compute_logits, YuE2ARForCausalLM.forward, Sampler.forward

    def compute_logits(self, hidden_states):
        with torch.profiler.record_function("head"):
            if mode["head"] == "full":
                return self.logits_processor(vllm_full_head(self), hidden_states)
            if mode["head"] == "plain-slice":
                return plain_slice_logits(self, hidden_states)
            return saved[0](self, hidden_states)

    def forward(self, *args, **kwargs):
        with torch.profiler.record_function("forward"):
            return saved[1](self, *args, **kwargs)

    def sample(self, *args, **kwargs):
        with torch.profiler.record_function("sampler"):
            return saved[2](self, *args, **kwargs)

    YuE2ARForCausalLM.compute_logits, YuE2ARForCausalLM.forward, Sampler.forward = compute_logits, forward, sample
    try:
        yield
    finally:
        YuE2ARForCausalLM.compute_logits, YuE2ARForCausalLM.forward, Sampler.forward = saved


def decode(engine, phase: str, rows: int, steps: int, profiler=None, turns=None) -> list[float]:
    """Seconds of each decode step of `rows` fresh requests of `phase` (their prefill steps excluded); `turns`,
    if given, is called with each step's index before the step (to switch heads)."""
    from yue2_vllm.bench import prompts
    from yue2_vllm.engine.plugin import row_args
    from yue2_vllm.engine.worker import sampling_params
    from yue2_vllm.protocol import ABC_END, MUSIC_END, Sampling

    stop = ABC_END if phase == "abc" else MUSIC_END
    sampling = Sampling(min_tokens=steps + 1, max_tokens=steps + 1)
    for index, prompt in enumerate(prompts(phase, rows)):
        params = sampling_params({"max_tokens": steps + 1, "stop": [stop],
                                  "extra_args": row_args(phase, sampling, index)})
        engine.add_request(f"{phase}-{time.monotonic_ns()}-{index}", {"prompt_token_ids": prompt}, params)
    started = set()
    while len(started) < rows:  # prefill (chunked) until every request has its first token
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    times = []
    if profiler is not None:
        profiler.__enter__()
    while engine.has_unfinished_requests():
        if turns is not None:
            turns(len(times))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if profiler is not None:
        profiler.__exit__(None, None, None)
    return times


def breakdown(profiler, steps: int, top: int) -> tuple[dict, list[tuple[str, float]]]:
    """ms per step in each labelled part, and the head's heaviest ops (self CPU ms per step)."""
    events = profiler.events()
    parts = {name: sum(e.cpu_time_total for e in events if e.name == name) / 1e3 / steps for name in PARTS}
    inside: dict[str, float] = {}
    for event in events:
        if event.name in PARTS or event.cpu_parent is None:
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name not in PARTS:
            parent = parent.cpu_parent
        if parent is not None and parent.name == "head":
            inside[event.name] = inside.get(event.name, 0.0) + event.self_cpu_time_total / 1e3 / steps
    return parts, sorted(inside.items(), key=lambda item: -item[1])[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="one-layer", help="'one-layer' (real width and vocabulary), '' (tiny "
                                                              "default) or a YuE2 MoT directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--heads", default="sliced,full", help=f"comma list of {', '.join(HEADS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_USE_V2_MODEL_RUNNER": "0"}.items():
        os.environ.setdefault(key, value)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from yue2_vllm.bench import machine, one_layer_slice
    from yue2_vllm.derive import derive_ar_checkpoint
    from yue2_vllm.engine.worker_process import cpu_split
    from yue2_vllm.testing import tiny_default

    torch.set_num_threads(cpu_split()[0])  # the engine worker's share of the cores, as in the backend
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="yue2-profile-"))
    model_dir = (one_layer_slice(workdir / "one-layer") if args.model == "one-layer"
                 else Path(args.model) if args.model else tiny_default()[0])
    rows = [int(r) for r in args.rows.split(",")]
    heads = args.heads.split(",")
    if set(heads) - set(HEADS) or "full" not in heads:
        parser.error(f"--heads: a comma list of {', '.join(HEADS)} that names full")
    engine = build(derive_ar_checkpoint(model_dir, workdir / "arcache"), args.dtype, max(rows))
    mode = {"head": "sliced"}
    m = machine()
    print(f"# decode step profile: {args.model or 'tiny default'}, {args.dtype}, {m['cpu_isa']}, "
          f"{torch.get_num_threads()} thread(s), vLLM {m['vllm']}, torch {m['torch']}\n")
    print("Step ms: the median over the unprofiled runs of each head's median step (the heads take turns step by "
          "step); forward / head / sampler / other: ms per step of one profiled run per head (its mean step in "
          "brackets).\n")
    print("| phase | rows | head | step ms | / full | forward | head | sampler | other |")
    print("|---|---|---|---|---|---|---|---|---|")
    ops = []
    with labelled(mode):
        for phase in ("abc", "semantic"):
            for count in rows:
                for head in heads:  # warm every path (kernel caches, the full head's packing)
                    mode["head"] = head
                    decode(engine, phase, count, 2)
                step: dict[str, list[float]] = {head: [] for head in heads}
                for repeat in range(args.repeats):
                    def turn(index: int, repeat: int = repeat) -> None:
                        mode["head"] = heads[(index + repeat) % len(heads)]
                    times = decode(engine, phase, count, args.steps * len(heads), turns=turn)
                    for head_index, head in enumerate(heads):
                        own = [t for i, t in enumerate(times) if (i + repeat) % len(heads) == head_index]
                        step[head].append(statistics.median(own) * 1e3)
                medians = {head: statistics.median(values) for head, values in step.items()}
                for head in heads:
                    mode["head"] = head
                    profiler = profile(activities=[ProfilerActivity.CPU])
                    profiled = statistics.mean(decode(engine, phase, count, args.steps, profiler)) * 1e3
                    parts, inside = breakdown(profiler, args.steps, args.top)
                    other = max(0.0, profiled - sum(parts.values()))
                    ratio = f"{medians[head] / medians['full']:.2f}"
                    print(f"| {phase} | {count} | {head} | {medians[head]:.1f} | {ratio} | {parts['forward']:.1f} | "
                          f"{parts['head']:.1f} | {parts['sampler']:.1f} | {other:.1f} ({profiled:.1f}) |", flush=True)
                    ops.append((phase, count, head, inside))
    print("\nInside the head, self CPU ms per step (profiled run):\n")
    for phase, count, head, inside in ops:
        print(f"- {phase}, {count} row(s), {head}: " + ", ".join(f"`{name}` {ms:.2f}" for name, ms in inside))


if __name__ == "__main__":
    main()
