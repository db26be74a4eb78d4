"""`yue2-vllm` command line."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _resolve_dirs(args) -> tuple[Path, Path]:
    from .testing import tiny_default

    if args.model is None and args.vae is None:
        return tiny_default()
    if args.model is None or args.vae is None:
        raise SystemExit("give both --model and --vae, or neither for the embedded tiny default")
    return Path(args.model), Path(args.vae)


def cmd_make_tiny(args) -> int:
    from .testing import write_tiny_model, write_tiny_vae

    out = Path(args.directory)
    model_dir, vae_dir = write_tiny_model(out / "YuE2-3B-tiny", seed=args.seed), write_tiny_vae(out / "YuE2-Vae-tiny",
                                                                                                  seed=args.seed)
    print(json.dumps({"model": str(model_dir), "vae": str(vae_dir)}))
    return 0


def cmd_demo(args) -> int:
    """Load a model + VAE, run one AR prefill, one NAR velocity and one VAE decode, print a summary."""
    import torch

    from .modeling import CachedNAR, load_model
    from .protocol import CODEC_OFFSET, MUSIC_END, SongRequest, abc_prompt, allowed_token_ids, semantic_prompt
    from .tokenizer import YuE2Tokenizer
    from .vae import load_vae

    model_dir, vae_dir = _resolve_dirs(args)
    timing = {}
    start = time.perf_counter()
    tokenizer = YuE2Tokenizer.from_model_dir(model_dir)
    model = load_model(model_dir)
    vae = load_vae(vae_dir)
    timing["load_seconds"] = time.perf_counter() - start

    request = SongRequest(style="piano pop, female vocal", lyrics="[verse]\nla la la\n", cot="full")
    prompt = abc_prompt(request, tokenizer)
    start = time.perf_counter()
    logits = model.forward_ar(torch.tensor([prompt])).float()[0, -1]
    allowed = torch.tensor(allowed_token_ids("abc"))
    top_token = int(allowed[logits[allowed].argmax()])
    timing["ar_prefill_seconds"] = time.perf_counter() - start

    frames = args.frames
    codec = torch.randint(0, 32768, (frames,), generator=torch.Generator().manual_seed(request.seed)).tolist()
    prefix = semantic_prompt(request, tokenizer, tokenizer.encode("X:1\nK:C\nCDEF|"))
    start = time.perf_counter()
    nar = CachedNAR(model, prefix + [CODEC_OFFSET + c for c in codec] + [MUSIC_END], frames)
    noise = torch.randn(frames, 64, generator=torch.Generator().manual_seed(request.seed))
    velocity = nar.velocity(noise.to(model.dtype), 20.0).float()
    timing["nar_velocity_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    audio = vae.decode((noise - velocity).T[None])
    timing["vae_seconds"] = time.perf_counter() - start

    print(json.dumps({
        "model": str(model_dir), "vae": str(vae_dir), "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size, "abc_prompt_tokens": len(prompt),
        "abc_first_token": {"id": top_token, "text": tokenizer.decode([top_token])},
        "logits_std": round(logits.std().item(), 4), "nar_frames": frames,
        "velocity_std": round(velocity.std().item(), 4), "audio_shape": list(audio.shape),
        "audio_samples_expected": 1920 * frames - 64, "timing": {k: round(v, 4) for k, v in timing.items()},
    }, ensure_ascii=False, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yue2-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", help="write the tiny deterministic MoT + VAE checkpoints into DIR")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny)

    demo = sub.add_parser("demo", help="load a model (default: embedded tiny) and run one forward of each stage")
    demo.add_argument("--model", help="YuE2 MoT directory (config.json, model.safetensors, qwen.tiktoken)")
    demo.add_argument("--vae", help="YuE2 VAE directory")
    demo.add_argument("--frames", type=int, default=8, help="latent frames for the NAR/VAE check")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
