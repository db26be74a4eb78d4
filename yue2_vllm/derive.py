"""The AR half as a Qwen3 checkpoint that vLLM serves: derivation, override and validation.

`derive_ar_checkpoint` copies the 3 + 11·layers AR tensors byte for byte into a content-addressed
cache (key: source weights identity + converted config), under an exclusive lock, into a temp
directory renamed into place, with a `derivation.json` recording the source and every file's
sha256 — the same layout and key as upstream's `yue2.fast`, so the two share a cache.
`YUE2_AR_CHECKPOINT` (or an explicit argument) replaces derivation with a prepared directory
(FP8/int8 compressed-tensors or any Qwen3 AR checkpoint), which is validated here before use; whether a
quantized one is served or declined is `quant.policy.resolve_ar_checkpoint`'s decision.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import (FLOAT_DTYPES, CheckpointError, HashCache, atomic_directory, identity, model_identity,
                         read_json,
                         sha256_file, weight_index, write_json_atomic, write_safetensors_subset)
from .model.modeling import YuE2Config, ar_tensor_shapes
from .quant_scheme import QUANT_SUFFIXES, QuantScheme, parse_quantization

SCHEMA = 1
DERIVATION_FILE = "derivation.json"
OVERRIDE_ENV = "YUE2_AR_CHECKPOINT"
# Tests only: seconds added per copied block, so a derivation of the tiny model lasts long enough to be stopped.
SLOW_DERIVE_ENV = "YUE2_TEST_DERIVE_BLOCK_DELAY_S"
# Config fields that must equal the MoT's for the AR weights to mean the same thing.
MATCHED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta")


class DerivationError(CheckpointError):
    """A derived cache entry or an override directory is unusable; the message says how to fix it."""


def qwen_config(config: YuE2Config) -> dict:
    """The `Qwen3ForCausalLM` config of the AR half, mapped as upstream maps it."""
    fields = {name: getattr(config, name) for name in MATCHED_FIELDS}
    return {**fields, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": False,
            "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 0, "torch_dtype": "bfloat16"}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    base = cache_dir or os.environ.get("YUE2_CACHE") or os.environ.get("HF_HOME") \
        or Path.home() / ".cache" / "huggingface"
    return Path(base) / "yue2-ar"


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    import fcntl

    with open(lock_path, "a", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _verify_derived(target: Path, stamp: dict, key: str, hashes: HashCache, verify: bool) -> None:
    clear = f"delete {target} to rebuild it"
    record_path = target / DERIVATION_FILE
    if not record_path.is_file():
        raise DerivationError(f"Corrupt derived AR cache: {record_path} is missing; {clear}")
    record = read_json(record_path)
    if record.get("identity") != key or record.get("source") != stamp["source"] \
            or record.get("config") != stamp["config"]:
        raise DerivationError(f"Corrupt derived AR cache: {record_path} does not describe this source; {clear}")
    for name, digest in (record.get("sha256") or {}).items():
        path = target / name
        if not path.is_file() or (sha256_file(path) if verify else hashes.sha256(path)) != digest:
            raise DerivationError(f"Corrupt derived AR cache: {path} does not match its sha256 in "
                                  f"{DERIVATION_FILE}; {clear}")
    if set(record.get("sha256") or {}) != {"model.safetensors", "config.json"}:
        raise DerivationError(f"Corrupt derived AR cache: {record_path} lists {sorted(record.get('sha256') or {})}; "
                              f"{clear}")


def remove_stale_temps(root: Path, key: str) -> list[Path]:
    """Remove the `.<key>.*.tmp` directories a killed derivation left (up to 4.3 GB each). Called with the key's
    lock held: a live derivation holds that lock for as long as its temp exists, so every one found is stale."""
    removed = []
    for tmp in sorted(root.glob(f".{key}.*.tmp")):
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def _slowed(on_block):
    """`on_block` with the test-only per-block delay of SLOW_DERIVE_ENV (none unless it is set)."""
    delay = float(os.environ.get(SLOW_DERIVE_ENV) or 0)
    if delay <= 0:
        return on_block

    def slow(nbytes: int) -> None:
        time.sleep(delay)
        if on_block is not None:
            on_block(nbytes)

    return slow


def derivation_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the AR tensors a derivation copies (the size of its model.safetensors, less the header)."""
    config = YuE2Config.load(Path(model_dir))
    infos = weight_index(model_dir)
    return sum(infos[name].nbytes for name in ar_tensor_shapes(config) if name in infos)


def derive_ar_checkpoint(model_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None, *,
                         hashes: HashCache | None = None, verify: bool = False, on_block=None) -> Path:
    """The derived Qwen3 AR checkpoint of a YuE2 MoT directory (built once, verified on reuse).

    Reuse trusts the hash cache (size + mtime) unless `verify`, which re-hashes the source and
    the cached files (catching a same-size change whose mtime was put back). `on_block(nbytes)` hears every
    block copied (and `on_block(0)` every block of the source hashed); raising there (e.g.
    `startup.StepAborted`) stops the derivation and removes its temp directory. Temps left by a killed
    derivation of the same key are removed first, under the lock."""
    model_dir = Path(model_dir)
    hashes = hashes or HashCache(None)
    config = YuE2Config.load(model_dir)
    infos = weight_index(model_dir)
    shapes = ar_tensor_shapes(config)
    missing = [name for name in shapes if name not in infos]
    if missing:
        raise CheckpointError(f"{model_dir}: Missing AR tensors ({len(missing)}): {', '.join(missing[:10])}")
    wrong = [f"{name} {list(infos[name].shape)} != {list(shape)}" for name, shape in shapes.items()
             if infos[name].shape != shape]
    if wrong:
        raise CheckpointError(f"{model_dir}: AR tensors with wrong shapes: {'; '.join(wrong[:10])}")
    stamp = {"schema": SCHEMA, "source": model_identity(model_dir, hashes=hashes, verify=verify,
                                                      on_block=on_block and (lambda nbytes: on_block(0))),
             "config": qwen_config(config)}
    key = identity(stamp)
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / key
    with _exclusive(root / f"{key}.lock"):
        remove_stale_temps(root, key)
        if target.exists():
            _verify_derived(target, stamp, key, hashes, verify)
            return target
        with atomic_directory(target) as tmp:
            weights_sha = write_safetensors_subset([infos[name] for name in shapes], tmp / "model.safetensors",
                                                   {"format": "pt"}, on_block=_slowed(on_block))
            write_json_atomic(tmp / "config.json", stamp["config"])
            write_json_atomic(tmp / DERIVATION_FILE, {
                **stamp, "identity": key, "tensor_count": len(shapes),
                "sha256": {"model.safetensors": weights_sha, "config.json": sha256_file(tmp / "config.json")}})
        hashes.remember(target / "model.safetensors", weights_sha)  # the next reuse need not re-read 4 GB
    return target


# --------------------------------------------------------------------------- override / validation


def _rope_theta(config: dict):
    if "rope_theta" in config:
        return config["rope_theta"]
    return (config.get("rope_parameters") or {}).get("rope_theta")


def _config_problems(ar_config: dict, mot: YuE2Config) -> list[str]:
    problems = []
    if "Qwen3ForCausalLM" not in (ar_config.get("architectures") or []):
        problems.append(f"architectures {ar_config.get('architectures')} is not ['Qwen3ForCausalLM']")
    for name in MATCHED_FIELDS:
        value = _rope_theta(ar_config) if name == "rope_theta" else ar_config.get(name)
        want = getattr(mot, name)
        if value is None or float(value) != float(want):
            problems.append(f"{name} is {value!r}, the MoT has {want!r}")
    if ar_config.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings is true (YuE2 has a separate lm_head)")
    return problems


def _quantized_dtypes(scheme: QuantScheme) -> frozenset[str]:
    """Dtypes a quantized linear's `weight` may be stored in under its compressed-tensors scheme."""
    if scheme.weight_type == "float":
        return frozenset({"F8_E4M3", "F8_E5M2"})
    return frozenset({"I8"})


KV_SCALE_SUFFIXES = ("k_scale", "v_scale", "q_scale")  # self_attn's, in a checkpoint that declares a kv_cache_scheme


def _tensor_problems(path: Path, mot: YuE2Config, scheme: QuantScheme | None, kv_scales: bool = False) -> list[str]:
    infos = weight_index(path)
    shapes = ar_tensor_shapes(mot)
    quantized: set[str] = set()
    if scheme is not None:
        quantized = {name[:-len(".weight")] for name in shapes if name.endswith("_proj.weight")}
        if "lm_head" not in scheme.ignore:
            quantized.add("lm_head")
    problems = []
    for name, shape in shapes.items():
        module = name.rsplit(".", 1)[0]
        if name in infos:
            if infos[name].shape != shape:
                problems.append(f"{name}: shape {list(infos[name].shape)}, expected {list(shape)}")
            allowed_dtypes = _quantized_dtypes(scheme) if module in quantized else FLOAT_DTYPES
            if infos[name].dtype not in allowed_dtypes:
                problems.append(f"{name}: dtype {infos[name].dtype}, expected one of {sorted(allowed_dtypes)}")
        elif not (module in quantized and f"{module}.weight_packed" in infos):
            problems.append(f"missing {name}")
    allowed = set(shapes) | {f"{module}.{suffix}" for module in quantized for suffix in QUANT_SUFFIXES}
    if kv_scales:
        allowed |= {f"model.layers.{i}.self_attn.{suffix}" for i in range(mot.num_hidden_layers)
                    for suffix in KV_SCALE_SUFFIXES}
    unexpected = sorted(set(infos) - allowed)
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:10])}")
    return problems


@dataclass(frozen=True)
class ARCheckpoint:
    """The directory vLLM will serve, where it came from, and its quantization."""

    path: Path
    source: str  # "derived" | "override"
    quantization: QuantScheme | None
    unservable: str | None = None  # why vLLM cannot run it on this device, if it cannot
    declined: str | None = None  # a requested override that is served as the derived bf16 checkpoint, and why
    slow: str | None = None  # a quantized override served although it is slower than bf16 here (policy "force")
    kernel: dict | None = None  # CUDA W8A8: the vLLM kernel it runs on (quant.schemes.KernelChoice.to_dict)

    def describe(self) -> dict:
        described = {"path": str(self.path), "source": self.source,
                     "quantization": self.quantization.to_dict() if self.quantization else None}
        if self.kernel:
            described["kernel"] = self.kernel
        if self.declined:
            described["declined"] = self.declined
        if self.slow:
            described["slow"] = self.slow
        return described


def validate_ar_checkpoint(path: str | os.PathLike, mot: YuE2Config) -> QuantScheme | None:
    """Check an AR checkpoint against the MoT before any engine starts; all problems in one error."""
    path = Path(path)
    what = f"AR checkpoint {path}"
    if not (path / "config.json").is_file():
        raise DerivationError(f"{what}: no config.json")
    ar_config = read_json(path / "config.json")
    try:
        scheme = parse_quantization(ar_config)
    except ValueError as exc:
        raise DerivationError(f"{what}: {exc}") from None
    kv_scales = bool((ar_config.get("quantization_config") or {}).get("kv_cache_scheme"))
    problems = _config_problems(ar_config, mot) + _tensor_problems(path, mot, scheme, kv_scales)
    if problems:
        raise DerivationError(f"{what} does not match the YuE2 model: " + "; ".join(problems))
    return scheme
