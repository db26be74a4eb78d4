"""Adapters converted once into a content-addressed cache, in the forms the two sides load.

`convert_adapter(path, config)` reads and checks an adapter (`layouts`, `checks`) and writes, under a key made of
its files' sha256, the base model's shape and the converter's version, one directory:

* `ar/`: the AR part as the PEFT directory vLLM's LoRA loader takes: `adapter_config.json` (`r` = the largest AR
  rank, `lora_alpha` = `r`, so vLLM's own scale is 1; `target_modules` limited to the q/k/v/o and gate/up/down
  projections) and `adapter_model.safetensors` with the keys vLLM's Qwen3 expects
  (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`). The layout's scale is folded into B (in
  float32, kept as float32 unless it is 1). A request's scale is vLLM's `lora_alpha` (`ar_directory(scale)`:
  a sibling directory with its own config beside a hard link of the same tensors).
* `nar.safetensors`: the NAR part as the torch side applies it: `<module>.lora_A` / `.lora_B` (B scaled as
  above), `<module>.diff` / `.diff_b` (additive), `<module>.weight` / `.bias` (replacements).
* `conversion.json`: the record: source files and their sha256, layout, what was read and how (scale rule,
  fused splits), the summary (half, ranks, projections), the card (licence, triggers) and every output's
  sha256, checked when the entry is reused.

Everything is written into a temp directory renamed into place, under an exclusive lock per key.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .. import peft_format as peft
from ..checkpoint import (HashCache, atomic_directory, cache_root, default_hash_cache, identity, load_tensors,
                          read_header, read_json, sha256_file, write_json_atomic)
from ..derive import MATCHED_FIELDS, _exclusive
from ..model.lora import Additive, Edits, LowRank, Replacement
from ..model.modeling import YuE2Config
from .checks import MAX_RANK, Summary, check_adapter, max_lora_rank_for
from .halves import AR_PROJECTIONS, half_of
from .layouts import locate, read_adapter
from .record import AdapterRecord, ARPart, NARPart
from .weights import AdapterError, Diff, Full, Pair

CONVERTER = "yue2-vllm-adapters-1"
SCHEMA = 1
RECORD, AR_DIR, NAR_FILE = "conversion.json", "ar", "nar.safetensors"


def adapters_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir) if cache_dir is not None else cache_root() / "adapters"


def source_files(path: Path, hashes: HashCache) -> dict[str, dict]:
    """`{name relative to the adapter: {sha256, bytes}}` of every file an adapter is read from."""
    base = path if path.is_dir() else path.parent
    files = {}
    for part in locate(path):
        for file in (part.weights, part.config):
            if file is not None:
                files[str(file.relative_to(base))] = {"sha256": hashes.sha256(file), "bytes": file.stat().st_size}
    return files


def content_sha256(files: dict[str, dict]) -> str:
    """An adapter's content hash: a single file's own sha256, else the identity of `{name: sha256}`."""
    if len(files) == 1:
        return next(iter(files.values()))["sha256"]
    return identity({name: entry["sha256"] for name, entry in files.items()})


def _fold(change: Pair) -> torch.Tensor:
    return change.b.clone() if change.scale == 1 else change.b.float() * change.scale


def _peft_tensors(modules: dict) -> dict[str, torch.Tensor]:
    out = {}
    for module, change in sorted(modules.items()):
        a_key, b_key = peft.lora_keys(module)
        # Copies: a fused pair's parts share one A, and safetensors stores no shared tensors.
        out[a_key], out[b_key] = change.a.clone(), _fold(change).contiguous()
    return out


def _nar_tensors(modules: dict) -> dict[str, torch.Tensor]:
    out = {}
    for module, change in sorted(modules.items()):
        if isinstance(change, Pair):
            out[f"{module}.lora_A"], out[f"{module}.lora_B"] = change.a.clone(), _fold(change).contiguous()
            continue
        names = ("diff", "diff_b") if isinstance(change, Diff) else ("weight", "bias")
        for name, tensor in zip(names, (change.weight, change.bias)):
            if tensor is not None:
                out[f"{module}.{name}"] = tensor.clone()
    return out


def peft_config(rank: int, modules, scale: float = 1.0) -> dict:
    """The `adapter_config.json` vLLM reads for the AR part at a request's `scale` (its scaling = alpha / r)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), "bias": "none",
            "use_rslora": False, "base_model_name_or_path": None}


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


@dataclass
class Converted:
    """One converted adapter (a cache entry): where its parts are and what its record says."""

    directory: Path
    record: AdapterRecord
    _tensors: dict = field(default_factory=dict, repr=False)

    @property
    def sha256(self) -> str:
        return self.record.sha256

    @property
    def summary(self) -> Summary:
        return self.record.summary

    @property
    def half(self) -> str:
        return self.summary.half

    @property
    def ar_rank(self) -> int:
        return self.summary.ar_rank

    @property
    def ar_path(self) -> Path | None:
        return self.directory / AR_DIR if self.record.ar else None

    def scaled_ar_path(self, scale: float = 1.0) -> Path:
        """Where the PEFT directory vLLM loads for this adapter at `scale` is (`ar_directory` makes it): the AR
        part's own at 1, else a sibling per scale. Writes nothing."""
        if self.ar_path is None:
            raise AdapterError(f"{self.record.source}: has no AR part")
        scale = float(scale)
        return self.ar_path if scale == 1 else self.directory / f"{AR_DIR}-scale-{scale!r}"

    def ar_directory(self, scale: float = 1.0) -> Path:
        """The PEFT directory vLLM loads for this adapter at `scale` (made once per scale, atomically)."""
        target = self.scaled_ar_path(scale)
        if not target.is_dir():
            try:
                with atomic_directory(target) as tmp:
                    write_json_atomic(tmp / peft.CONFIG, peft_config(self.record.ar.rank,
                                                                     self.record.ar.target_modules, float(scale)))
                    try:
                        os.link(self.ar_path / peft.WEIGHTS, tmp / peft.WEIGHTS)
                    except OSError:
                        import shutil

                        shutil.copyfile(self.ar_path / peft.WEIGHTS, tmp / peft.WEIGHTS)
            except FileExistsError:
                pass  # another process made it
        return target

    def load_part(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._tensors:
            infos, _ = read_header(self.directory / name)
            self._tensors[name] = dict(load_tensors(infos.values()))
        return self._tensors[name]

    def ar_pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`{module: (lora_A, lora_B)}` of the AR part as stored (the layout's scale folded into B)."""
        tensors = self.load_part(f"{AR_DIR}/{peft.WEIGHTS}")
        modules = {peft.module_of(key): a for key, a in tensors.items()}
        return {module: (a, tensors[peft.lora_keys(module)[1]]) for module, a in modules.items() if module}

    def edits(self, scale: float = 1.0, half: str = "both") -> Edits:
        """The torch side's edits at a request's `scale`: LoRA deltas and additive deltas times `scale`,
        replacements at strength `scale` (`model.lora`)."""
        edits: dict[str, list] = {}
        if half in ("ar", "both") and self.record.ar:
            for module, (a, b) in self.ar_pairs().items():
                edits[module] = [LowRank(a, b, scale)]
        if half in ("nar", "both") and self.record.nar:
            tensors = self.load_part(NAR_FILE)
            for key in tensors:
                module, _, role = key.rpartition(".")
                if role == "lora_A":
                    edits[module] = [LowRank(tensors[key], tensors[f"{module}.lora_B"], scale)]
                elif role in ("diff", "diff_b") and module not in edits:
                    edits[module] = [Additive(tensors.get(f"{module}.diff"), tensors.get(f"{module}.diff_b"), scale)]
                elif role in ("weight", "bias") and module not in edits:
                    edits[module] = [Replacement(tensors.get(f"{module}.weight"), tensors.get(f"{module}.bias"),
                                                 scale)]
        return edits

    def tensor_bytes(self, half: str = "both") -> int:
        """Bytes of the converted tensors of a half as stored (what the torch side holds once it loads them)."""
        names = ([f"{AR_DIR}/{peft.WEIGHTS}"] if half in ("ar", "both") and self.record.ar else []) + \
            ([NAR_FILE] if half in ("nar", "both") and self.record.nar else [])
        return sum(info.nbytes for name in names for info in read_header(self.directory / name)[0].values())


def _verify(target: Path, key: str, hashes: HashCache) -> AdapterRecord:
    clear = f"delete {target} to convert it again"
    record_path = target / RECORD
    if not record_path.is_file():
        raise AdapterError(f"corrupt adapter cache: {record_path} is missing; {clear}")
    record = read_json(record_path)
    if record.get("key") != key or record.get("converter") != CONVERTER:
        raise AdapterError(f"corrupt adapter cache: {record_path} does not describe this adapter; {clear}")
    for name, digest in (record.get("outputs") or {}).items():
        path = target / name
        if not path.is_file() or hashes.sha256(path) != digest:
            raise AdapterError(f"corrupt adapter cache: {path} does not match its sha256 in {RECORD}; {clear}")
    return AdapterRecord.from_dict(record)


def convert_adapter(path: str | os.PathLike, config: YuE2Config, *, cache_dir: str | os.PathLike | None = None,
                    max_rank: int = MAX_RANK, hashes: HashCache | None = None) -> Converted:
    """The converted adapter at `path` for a base model of `config` (converted once, verified on reuse).

    AdapterError (one line naming the file and the tensor) when the adapter cannot be used; nothing is left
    behind then.
    """
    path = Path(path).expanduser().absolute()
    hashes = hashes or default_hash_cache()
    files = source_files(path, hashes)
    base = {name: getattr(config, name) for name in MATCHED_FIELDS}
    key = identity({"converter": CONVERTER, "files": sorted(entry["sha256"] for entry in files.values()),
                    "names": sorted(files), "base": base})
    root = adapters_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / key
    with _exclusive(root / f".{key}.lock"):
        if target.is_dir():
            record = _verify(target, key, hashes)
            if record.summary.rank > max_rank:
                raise AdapterError(f"{path}: rank {record.summary.rank} is above the limit {max_rank}")
            return Converted(target, record)
        adapter = read_adapter(path, config)
        summary = check_adapter(adapter, config, max_rank)
        ar = {m: c for m, c in adapter.modules.items() if half_of(m) == "ar"}
        nar = {m: c for m, c in adapter.modules.items() if half_of(m) == "nar"}
        card = adapter.card
        record = AdapterRecord(
            SCHEMA, CONVERTER, key, content_sha256(files), str(path), files, adapter.layout, tuple(adapter.notes),
            summary, base,
            ar=None if not ar else ARPart(AR_DIR, len(ar), summary.ar_rank, max_lora_rank_for(summary.ar_rank),
                                          tuple(sorted({m.rsplit(".", 1)[-1] for m in ar}))),
            nar=None if not nar else NARPart(NAR_FILE, len(nar), sum(isinstance(c, Pair) for c in nar.values()),
                                             sum(isinstance(c, Diff) for c in nar.values()),
                                             sum(isinstance(c, Full) for c in nar.values())),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            licence=card.get("licence"), triggers=tuple(card.get("triggers") or ()))
        assert not ar or set(record.ar.target_modules) <= set(AR_PROJECTIONS)
        metadata = {"format": "pt", "yue2_vllm_adapter": record.sha256}
        outputs = {}
        with atomic_directory(target) as tmp:
            if ar:
                (tmp / AR_DIR).mkdir()
                write_json_atomic(tmp / AR_DIR / peft.CONFIG, peft_config(summary.ar_rank, ar))
                save_tensors(tmp / AR_DIR / peft.WEIGHTS, _peft_tensors(ar), metadata)
                outputs[f"{AR_DIR}/{peft.CONFIG}"] = sha256_file(tmp / AR_DIR / peft.CONFIG)
                outputs[f"{AR_DIR}/{peft.WEIGHTS}"] = sha256_file(tmp / AR_DIR / peft.WEIGHTS)
            if nar:
                save_tensors(tmp / NAR_FILE, _nar_tensors(nar), metadata)
                outputs[NAR_FILE] = sha256_file(tmp / NAR_FILE)
            record = replace(record, outputs=outputs)
            write_json_atomic(tmp / RECORD, record.to_dict())
        return Converted(target, record)
