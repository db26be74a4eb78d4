"""Songs through the scheduler vs the same songs one after another, on the tiny default (vLLM backend).

For N in --songs (default 1 2 4 8): N songs at concurrency N and the same N songs at concurrency 1,
alternating which goes first, --repeats times, all on one resident engine (its start-up is timed
once, apart). Prints medians: songs/s of each and their ratio, aggregate and per-sequence AR tok/s,
the engine's and the synthesis lane's idle time, and the whole `batch` command at concurrency 8
vs 1 (engine start included, as a user runs it). Run: `.venv/bin/python bench/bench_concurrency.py`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from yue2_vllm.artifacts import verify_result
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import SongRequest
from yue2_vllm.scheduler import SongScheduler
from yue2_vllm.testing import TINY_GENERATION, tiny_default
from yue2_vllm.options import AROptions, EngineOptions

GENERATION = {**TINY_GENERATION, "abc": {"max_tokens": 48, "min_tokens": 48}}  # fixed budgets: 48 + 250 tokens


def run_songs(pipe: YuE2Pipeline, songs: int, concurrency: int, workdir: Path, tag: str) -> dict:
    requests = [SongRequest("pop, piano", f"[verse]\nla la {i}\n", seed=100 + i, id=f"{tag}-{i}") for i in range(songs)]
    out = workdir / tag
    shutil.rmtree(out, ignore_errors=True)
    engine = pipe.engine
    busy_before = engine.busy_seconds
    tokens = {"n": 0}

    def listen(event):
        if event.kind == "tokens":
            tokens["n"] += 1

    start = time.perf_counter()
    with SongScheduler(pipe, concurrency=concurrency, listener=listen) as scheduler:
        handles = [scheduler.submit(r, out / r.id) for r in requests]
        for handle in scheduler.as_completed(handles):
            if handle.state != "complete":
                raise RuntimeError(f"{handle.id}: {handle.state}: {handle.error}")
        lane_busy, batches = scheduler.lane.busy_seconds, list(scheduler.lane.batches)
    seconds = time.perf_counter() - start
    for r in requests:
        verify_result(out / r.id)
    documents = [json.loads((out / r.id / "result.json").read_text()) for r in requests]
    per_sequence = [d["timing"][p]["output_tps"] for d in documents for p in ("abc", "semantic")]
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "songs_per_s": songs / seconds, "ar_tok_s": tokens["n"] / seconds,
            "per_sequence_tok_s": statistics.median(per_sequence),
            "engine_idle_s": seconds - (engine.busy_seconds - busy_before), "lane_idle_s": seconds - lane_busy,
            "nar_batches": batches}


def whole_batch(concurrency: int, songs: int, workdir: Path) -> float:
    """`yue2-vllm batch` as a user runs it (new process, engine start included); wall seconds."""
    rows = workdir / "songs.jsonl"
    rows.write_text("".join(json.dumps({"id": f"b{i}", "style": "pop, piano", "lyrics": f"la {i}", "seed": i}) + "\n"
                            for i in range(songs)))
    out = workdir / f"batch{concurrency}"
    shutil.rmtree(out, ignore_errors=True)
    (workdir / "gen.json").write_text(json.dumps(GENERATION))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "batch", "--input", str(rows), "--backend", "vllm",
                    "--concurrency", str(concurrency), "--output", str(out), "--quiet", "--config",
                    str(workdir / "gen.json")], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    for i in range(songs):
        verify_result(out / f"b{i}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--songs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whole", type=int, default=1, help="repeats of the whole-command comparison (0: skip)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-concurrency-"))
    model_dir, vae_dir = tiny_default()
    start = time.perf_counter()
    pipe = YuE2Pipeline(model_dir, vae_dir, generation_config=GENERATION, ar=AROptions(backend="vllm"),
                        engine=EngineOptions(max_num_seqs=max(args.songs), start=True))
    pipe.select_ar_backend(1.0, False)  # wait for the engine
    print(f"pipeline + engine start: {time.perf_counter() - start:.1f} s "
          f"({pipe.engine.engine_info['engine_load_seconds']:.1f} s engine build)", flush=True)
    rows = []
    try:
        for n in args.songs:
            runs = {"concurrent": [], "sequential": []}
            for repeat in range(args.repeats):
                order = ("concurrent", "sequential") if repeat % 2 == 0 else ("sequential", "concurrent")
                for mode in order:
                    runs[mode].append(run_songs(pipe, n, n if mode == "concurrent" else 1, workdir, f"{mode}{n}"))
            med = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0] if key != "nar_batches"}
                   for mode, rs in runs.items()}
            rows.append((n, med, runs["concurrent"][-1]["nar_batches"]))
            c, s = med["concurrent"], med["sequential"]
            print(f"N={n}: {c['songs_per_s']:.3f} vs {s['songs_per_s']:.3f} songs/s = {c['songs_per_s'] / s['songs_per_s']:.2f}x;"
                  f" AR {c['ar_tok_s']:.0f} vs {s['ar_tok_s']:.0f} tok/s aggregate, {c['per_sequence_tok_s']:.0f} vs "
                  f"{s['per_sequence_tok_s']:.0f} per sequence; engine idle {c['engine_idle_s']:.1f}/{c['seconds']:.1f} s "
                  f"vs {s['engine_idle_s']:.1f}/{s['seconds']:.1f} s; lane idle {c['lane_idle_s']:.1f} vs "
                  f"{s['lane_idle_s']:.1f} s; NAR batches {runs['concurrent'][-1]['nar_batches']}", flush=True)
    finally:
        pipe.close()
    print("\n| songs | concurrent songs/s | sequential songs/s | ratio | AR tok/s (conc/seq) | per-seq tok/s | "
          "engine idle s (conc/seq) | lane idle s (conc/seq) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, med, _ in rows:
        c, s = med["concurrent"], med["sequential"]
        print(f"| {n} | {c['songs_per_s']:.3f} | {s['songs_per_s']:.3f} | {c['songs_per_s'] / s['songs_per_s']:.2f}x | "
              f"{c['ar_tok_s']:.0f} / {s['ar_tok_s']:.0f} | {c['per_sequence_tok_s']:.0f} / {s['per_sequence_tok_s']:.0f} | "
              f"{c['engine_idle_s']:.1f} / {s['engine_idle_s']:.1f} | {c['lane_idle_s']:.1f} / {s['lane_idle_s']:.1f} |")
    if args.whole:
        songs = max(args.songs)
        times = {1: [], songs: []}
        for repeat in range(args.whole):
            for c in ((songs, 1) if repeat % 2 == 0 else (1, songs)):
                times[c].append(whole_batch(c, songs, workdir))
        one, many = statistics.median(times[1]), statistics.median(times[songs])
        print(f"\nwhole `batch` of {songs} songs (engine start included): --concurrency {songs} {many:.1f} s, "
              f"--concurrency 1 {one:.1f} s: {one / many:.2f}x songs/s")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
