"""The other commands: derive, quantize, calibrate, evaluate, make-tiny, serve.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..request_json import UsageError
from .setup import check_kv_flag, print_status, song_setup

def cmd_derive(args) -> int:
    import time

    from ..derive import derive_ar_checkpoint
    from ..checkpoint import default_hash_cache

    from ..hub import resolve_model

    source = resolve_model(args.model, revision=args.revision, what="derive")
    start = time.perf_counter()
    path = derive_ar_checkpoint(source.path, args.out, hashes=default_hash_cache(), verify=args.verify_hashes)
    print(json.dumps({"ar_checkpoint": str(path), "seconds": round(time.perf_counter() - start, 3)}))
    return 0


def cmd_calibrate(args) -> int:
    from ..quant.calibration import DEFAULT_REQUESTS, build_corpus, load_request_set, summary

    request_set = load_request_set(args.requests or DEFAULT_REQUESTS)
    with song_setup(args, need_vae=False).pipeline() as pipe:
        manifest = build_corpus(pipe, request_set, args.output, window=args.window, limit=args.limit,
                                on_request=lambda i, n, rid: print(f"Request {i}/{n}: {rid}", file=sys.stderr))
    print(summary(manifest))
    return 0


def cmd_evaluate(args) -> int:
    from ..quant.evaluate import markdown_table, run_gate

    if args.kv_cache_dtype:
        from ..quant.kv_quality import kv_markdown, run_kv_gate

        if args.candidate:
            raise UsageError("evaluate: --kv-cache-dtype compares KV forms of the --reference; drop --candidate")
        report = run_kv_gate(args.reference, args.corpus, args.output, tuple(args.kv_cache_dtype))
        print(kv_markdown(report["rows"]), end="", file=sys.stderr)
        print(json.dumps({"output": args.output, "rows": len(report["rows"])}))
        return 0
    if not args.candidate:
        raise UsageError("evaluate: --candidate is required (or --kv-cache-dtype for the FP8 KV row)")
    report = run_gate(args.reference, args.candidate, args.corpus, args.output, floor=not args.no_floor)
    print(markdown_table(report["rows"]), end="", file=sys.stderr)
    print(json.dumps({"output": args.output, "rows": len(report["rows"]), "plots": report["plots"]}))
    return 0


def cmd_make_tiny(args) -> int:
    from ..testing import write_tiny_model, write_tiny_vae

    out = Path(args.directory)
    model_dir = write_tiny_model(out / "YuE2-3B-tiny", seed=args.seed)
    vae_dir = write_tiny_vae(out / "YuE2-Vae-tiny", seed=args.seed)
    print(json.dumps({"model": str(model_dir), "vae": str(vae_dir)}))
    return 0


def cmd_serve(args) -> int:
    from ..serve.runner import serve

    # Refused before the "starting" line; a Ray head checks what does not depend on the replicas' devices.
    local = getattr(args, "replicas", None) is None and getattr(args, "ray_address", None) is None
    check_kv_flag(args, on_this_machine=local)
    return serve(args, song_setup, print_status)


def cmd_quantize(args) -> int:
    from ..quant.export import main as export_main

    return export_main(args.export_arguments, prog="yue2-vllm quantize")
