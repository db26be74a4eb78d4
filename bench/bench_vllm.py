"""vLLM backend benchmarks, side by side in one run (CPU here; the same script runs on a GPU).

1. AR decode tokens/s for the same derived checkpoint: our backend (worker process, JSON
   streaming, YuE2's sampler in the engine, sliced head) vs bare vLLM (an engine stepping the same
   request in its own process with vLLM's own sampler, no protocol), and vs our torch backend.
2. CFG songs: useful (cond) tokens/s of paired CFG rows on vLLM vs plain songs on vLLM vs the torch CFG
   backend, at 1 and 8 songs at once.
3. Derivation of a full-size (28-layer, 7.3 GB) checkpoint: seconds and peak RSS, against
   copying the same number of bytes.

    python bench/bench_vllm.py [--tokens 256] [--repeats 3] [--skip-derive] [--skip-cfg] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from yue2_vllm.derive import ARCheckpoint, derive_ar_checkpoint
from yue2_vllm.model.loader import load_model
from yue2_vllm.model.modeling import YuE2Config, tensor_shapes
from yue2_vllm.protocol import EOD, MUSIC_START, Sampling, allowed_token_ids
from yue2_vllm.model.sampling import TorchARBackend
from yue2_vllm.testing import TINY_CONFIG, write_tiny_model
from yue2_vllm.engine.backend import EngineSettings, VLLMBackend

PREFIX = [EOD] + [100 + i for i in range(200)] + [MUSIC_START]


def decode_rate(timing: dict) -> float:
    """Decode tokens/s after the first token (prefill excluded)."""
    return (timing["output_tokens"] - 1) / (timing["seconds"] - timing["ttft_seconds"])


BARE = """
import json, sys, time
from vllm import EngineArgs, SamplingParams
from vllm.v1.engine.llm_engine import LLMEngine
checkpoint, kv_bytes, repeats, sampling, prefix, allowed = json.loads(sys.stdin.read())
engine = LLMEngine.from_engine_args(EngineArgs(
    model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=24576, max_num_seqs=1,
    max_num_batched_tokens=2048, enable_prefix_caching=True, enforce_eager=True, kv_cache_memory_bytes=kv_bytes,
    disable_log_stats=True))
rates = []
for repeat in range(repeats):
    params = SamplingParams(temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=sampling["top_k"],
                            min_tokens=sampling["min_tokens"], max_tokens=sampling["max_tokens"], seed=repeat,
                            detokenize=False, allowed_token_ids=allowed)
    start, first, count = time.perf_counter(), None, 0
    engine.add_request(f"r{repeat}", {"prompt_token_ids": prefix}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            count = len(output.outputs[0].token_ids)
            if first is None and count:
                first = time.perf_counter() - start
    rates.append((count - 1) / (time.perf_counter() - start - first))
print("RATES" + json.dumps(rates))
"""


def bare_vllm_rates(checkpoint: Path, config: YuE2Config, sampling: Sampling, repeats: int) -> list[float]:
    """The same request on a vLLM engine stepped directly in its own process (no JSON protocol, no parent)."""
    from yue2_vllm.engine.backend import kv_cache_bytes
    from yue2_vllm.engine.worker_process import cpu_split, worker_env

    args = json.dumps([str(checkpoint), kv_cache_bytes(config, 1, 24576 + 256), repeats, sampling.to_dict(), PREFIX,
                       allowed_token_ids("semantic")])
    out = subprocess.run([sys.executable, "-c", BARE], input=args, env=worker_env(cpu_split()[0]), check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out[out.index("RATES") + 5:].splitlines()[0])


def bench_decode(name: str, model_dir: Path, config: YuE2Config, workdir: Path, tokens: int, repeats: int,
                 rounds: int = 2) -> dict:
    """Bare vLLM and our backend alternate round by round (this machine's speed drifts by tens of
    percent over minutes); the ratio is the median of the per-round ratios."""
    checkpoint = derive_ar_checkpoint(model_dir, workdir / "arcache")
    sampling = Sampling(min_tokens=tokens, max_tokens=tokens)
    ours_all, bare_all, ratios = [], [], []
    for _ in range(rounds):
        bare = statistics.median(bare_vllm_rates(checkpoint, config, sampling, repeats))
        ours_backend = VLLMBackend(config, EngineSettings(ARCheckpoint(checkpoint, "derived", None)))
        try:
            ours = statistics.median(decode_rate(ours_backend.generate(PREFIX, sampling, seed, "semantic").timing)
                                     for seed in range(repeats))
        finally:
            ours_backend.close()
        bare_all.append(bare)
        ours_all.append(ours)
        ratios.append(ours / bare)
    torch_backend = TorchARBackend(load_model(model_dir))
    torch_tps = statistics.median(decode_rate(torch_backend.generate(PREFIX, sampling, seed, "semantic").timing)
                                  for seed in range(repeats))
    ours_tps = statistics.median(ours_all)
    return {"model": name, "tokens": tokens, "ours_vllm_tok_s": ours_all, "bare_vllm_tok_s": bare_all,
            "ours_over_bare": statistics.median(ratios), "torch_tok_s": torch_tps,
            "vllm_over_torch": ours_tps / torch_tps}


def bench_cfg(model_dir: Path, config: YuE2Config, workdir: Path, tokens: int, repeats: int) -> dict:
    """Useful tok/s (cond tokens) of CFG songs vs plain songs on vLLM, and of the torch CFG backend."""
    import threading

    checkpoint = derive_ar_checkpoint(model_dir, workdir / "arcache")
    sampling = Sampling(min_tokens=tokens, max_tokens=tokens)
    negative = [EOD, 100, 101, MUSIC_START]
    backend = VLLMBackend(config, EngineSettings(ARCheckpoint(checkpoint, "derived", None), max_num_seqs=16))

    def useful_rate(songs: int, cfg: bool) -> float:
        def one(i):
            backend.generate(PREFIX, sampling, i, "semantic", negative=negative if cfg else None,
                             cfg_scale=1.5 if cfg else 1.0)

        start = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(songs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return songs * tokens / (time.perf_counter() - start)

    report = {}
    try:
        backend.start()
        for songs in (1, 8):
            plain = statistics.median(useful_rate(songs, False) for _ in range(repeats))
            guided = statistics.median(useful_rate(songs, True) for _ in range(repeats))
            report[f"{songs}_songs"] = {"plain_tok_s": plain, "cfg_tok_s": guided, "cfg_over_plain": guided / plain}
    finally:
        backend.close()
    torch_backend = TorchARBackend(load_model(model_dir))
    torch_cfg = statistics.median(tokens / torch_backend.generate(PREFIX, sampling, seed, "semantic", negative=negative,
                                                                  cfg_scale=1.5).timing["seconds"]
                                  for seed in range(repeats))
    report["torch_cfg_tok_s"] = torch_cfg  # one song at a time: 8 songs run one after another
    for songs in (1, 8):
        report[f"{songs}_songs"]["vllm_cfg_over_torch_cfg"] = report[f"{songs}_songs"]["cfg_tok_s"] / torch_cfg
    return report


def write_full_size_checkpoint(directory: Path) -> Path:
    """A 628-tensor, 7.3 GB bf16 checkpoint with the real layout; the bytes are pseudo-random filler."""
    import struct

    config = YuE2Config()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    header, offset = {}, 0
    for name, shape in tensor_shapes(config).items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = os.urandom(64 * 2**20)
    with open(directory / "model.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        remaining = offset
        while remaining:
            out.write(block[:min(len(block), remaining)])
            remaining -= min(len(block), remaining)
    return directory


MEASURE = """
import json, sys, time
from pathlib import Path
start = time.perf_counter()
if sys.argv[1] == "derive":
    from yue2_vllm.derive import derive_ar_checkpoint
    out = derive_ar_checkpoint(sys.argv[2], sys.argv[3])
    written = (out / "model.safetensors").stat().st_size
else:
    with open(sys.argv[2], "rb") as src, open(sys.argv[3], "wb") as dst:
        remaining = written = int(sys.argv[4])
        while remaining:
            block = src.read(min(8 << 20, remaining)); dst.write(block); remaining -= len(block)
# VmHWM is this process's own peak (ru_maxrss would include what the forking parent had).
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": time.perf_counter() - start, "bytes": written,
                  "peak_rss_mib": int(hwm.split()[1]) / 1024}))
"""


def bench_derive(workdir: Path) -> dict:
    source = write_full_size_checkpoint(workdir / "full")
    derived = json.loads(subprocess.run([sys.executable, "-c", MEASURE, "derive", str(source), str(workdir / "dc")],
                                        check=True, capture_output=True, text=True).stdout)
    copied = json.loads(subprocess.run([sys.executable, "-c", MEASURE, "copy", str(source / "model.safetensors"),
                                        str(workdir / "copy.bin"), str(derived["bytes"])],
                                       check=True, capture_output=True, text=True).stdout)
    ar_gib = derived["bytes"] / 2**30
    return {"source_gib": (source / "model.safetensors").stat().st_size / 2**30, "ar_gib": ar_gib,
            "derive": derived, "copy": copied, "derive_over_copy_seconds": derived["seconds"] / copied["seconds"],
            "derive_peak_rss_over_ar_bytes": derived["peak_rss_mib"] / 1024 / ar_gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-derive", action="store_true")
    parser.add_argument("--skip-wide", action="store_true", help="skip the one-layer real-width model")
    parser.add_argument("--skip-cfg", action="store_true", help="skip the CFG comparison")
    parser.add_argument("--workdir", help="scratch directory (default: a temp dir, removed afterwards)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as scratch:
        workdir = Path(scratch)
        report = {"decode": [bench_decode("tiny", write_tiny_model(workdir / "tiny"), TINY_CONFIG, workdir,
                                          args.tokens, args.repeats)]}
        if not args.skip_wide:
            wide = YuE2Config(num_hidden_layers=1)
            report["decode"].append(bench_decode("real_width_1_layer", write_tiny_model(workdir / "wide", config=wide),
                                                 wide, workdir, args.tokens // 4, args.repeats))
        if not args.skip_cfg:
            report["cfg_tiny"] = bench_cfg(workdir / "tiny", TINY_CONFIG, workdir, args.tokens // 2, args.repeats)
        if not args.skip_derive:
            report["derivation_full_size"] = bench_derive(workdir)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
