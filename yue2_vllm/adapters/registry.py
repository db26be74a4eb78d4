"""The adapters a process serves, by name, and what a request or a command line asks of them.

`serve --lora-modules name=path …` (vLLM's convention; a JSON `{"name", "path"}` also) registers named
adapters; `generate`/`batch` `--lora PATH_OR_HUB_ID[:SCALE]` register theirs under the file's stem. Every
registration converts and checks the adapter first (`cache.convert_adapter`): a bad one raises AdapterError and
leaves the registry as it was. A request names adapters with a scale each (`AdapterUse`); an unknown name or a
scale out of `SCALE_RANGE` is refused, naming it.
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from .. import peft_format as peft
from ..hub import HubOptions, is_repo_id, resolve_model
from ..model.modeling import YuE2Config
from ..protocol import ADAPTER_NAME as NAME
from ..protocol import ADAPTER_SCALE_RANGE as SCALE_RANGE
from ..protocol import AdapterRef
from .cache import Converted, convert_adapter
from .checks import MAX_RANK
from .layouts import CARD, LORA_JSON
from .weights import AdapterError

# What a Hub repo id fetches for an adapter (a subpath narrows it to one file or directory).
HUB_PATTERNS = ("*.safetensors", "*/*.safetensors", peft.CONFIG, f"*/{peft.CONFIG}", LORA_JSON, f"*/{LORA_JSON}", CARD)


class UnknownAdapter(AdapterError):
    """A request names an adapter the registry does not hold."""

    def __str__(self) -> str:
        return self.args[0]


def check_scale(scale, where: str = "scale") -> float:
    """A finite number inside SCALE_RANGE (AdapterError naming `where` otherwise)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
        raise AdapterError(f"{where}: {scale!r} is not a number in [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}]")
    return float(scale)


@dataclass(frozen=True)
class LoraSpec:
    """`--lora PATH_OR_HUB_ID[:SCALE]` as given."""

    source: str
    scale: float = 1.0


def parse_lora_spec(text: str) -> LoraSpec:
    """`PATH_OR_HUB_ID[:SCALE]`; a tail after the last `:` that is not a number belongs to the path."""
    source, _, tail = text.rpartition(":")
    if source:
        try:
            value = float(tail)
        except ValueError:
            pass
        else:
            return LoraSpec(source, check_scale(value, f"--lora {text}"))
    if not text:
        raise AdapterError("--lora needs a path or a Hub repo id")
    return LoraSpec(text)


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` or `{"name": …, "path": …}` (vLLM's `--lora-modules` forms) → `(name, path)`."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AdapterError(f"--lora-modules {text}: not JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
            raise AdapterError(f"--lora-modules {text}: needs string fields name and path")
        return data["name"], data["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise AdapterError(f"--lora-modules {text}: expected name=path")
    return name, path


def resolve_adapter_path(source: str, *, hub: HubOptions = HubOptions(), env: Mapping[str, str] = os.environ) -> Path:
    """A local path as it is, or a Hub repo id (`owner/repo`, `owner/repo/sub/path`, `owner/repo@revision…`)
    fetched into the Hugging Face cache (the adapter's files and its card only)."""
    local = Path(source).expanduser()
    parts = source.split("/")
    repo, _, revision = "/".join(parts[:2]).partition("@")
    if local.exists() or source.startswith((".", "~", "/")) or len(parts) < 2 or not is_repo_id(repo):
        return local
    inner = "/".join(parts[2:])
    patterns = HUB_PATTERNS if not inner else (inner, f"{inner}/*", f"{inner}/*/*", "README.md")
    snapshot = resolve_model(repo, revision=revision or None, what="adapter", hub=hub, env=env,
                             patterns=patterns)
    return Path(snapshot.path) / inner


def spec_names(specs: Iterable[LoraSpec], taken: Iterable[str] = ()) -> list[tuple[str, LoraSpec]]:
    """A name for each `--lora` spec: its file's or directory's stem (`ar_lora_inst_v3abc`, a Hub repo's name), made
    unique against `taken` and each other (`style-2`); the same source twice keeps one name."""
    used, by_source, named = set(taken), {}, []
    for spec in specs:
        if spec.source in by_source:
            named.append((by_source[spec.source], spec))
            continue
        stem = Path(spec.source.rstrip("/")).name.removesuffix(".safetensors") or "adapter"
        stem = re.sub(r"[^A-Za-z0-9_.:@+-]", "_", stem)[:100].lstrip("_.:@+-") or "adapter"
        name, count = stem, 1
        while name in used:
            count += 1
            name = f"{stem}-{count}"
        used.add(name)
        by_source[spec.source] = name
        named.append((name, spec))
    return named


@dataclass(frozen=True)
class Adapter:
    """A registered adapter."""

    name: str
    source: str  # as given (path or Hub id)
    converted: Converted

    @property
    def sha256(self) -> str:
        return self.converted.sha256

    @property
    def half(self) -> str:
        return self.converted.half

    def info(self) -> dict:
        """What GET /v1/adapters lists: name, half, rank, modules, sha256, layout, licence (and what else the
        record knows)."""
        record = self.converted.record
        summary = record.summary
        return {"name": self.name, "half": summary.half, "rank": summary.rank,
                "modules": list(summary.projections), "module_count": summary.modules, "sha256": record.sha256,
                "layout": record.layout, "licence": record.licence, "triggers": list(record.triggers),
                "source": self.source}


@dataclass(frozen=True)
class AdapterUse:
    """One adapter a song uses, at a scale."""

    adapter: Adapter
    scale: float = 1.0

    def identity(self) -> dict:
        """What enters the song's identity and result.json: the content hash and the scale (not the name)."""
        return {"sha256": self.adapter.sha256, "scale": self.scale}

    @property
    def ref(self) -> AdapterRef:
        return AdapterRef(self.adapter.name, self.scale)

    def record(self) -> dict:
        """result.json's entry: name, half, rank, layout, licence, content hash and scale."""
        record = self.adapter.converted.record
        return {"name": self.adapter.name, "half": self.adapter.half, **self.identity(), "rank": record.summary.rank,
                "layout": record.layout, "licence": record.licence}


class AdapterRegistry:
    """Named adapters for one base model. Thread-safe; a failed registration changes nothing."""

    def __init__(self, config: YuE2Config, *, cache_dir: str | os.PathLike | None = None, max_rank: int = MAX_RANK,
                 hub: HubOptions = HubOptions()):
        self.config, self.cache_dir, self.max_rank, self.hub = config, cache_dir, max_rank, hub
        self._adapters: dict[str, Adapter] = {}
        self._lock = threading.Lock()

    def register(self, name: str, source: str | os.PathLike) -> Adapter:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise AdapterError(f"adapter name {name!r}: use letters, digits and _ . : @ + - (up to 128, starting "
                               "with a letter or digit)")
        source = os.fspath(source)
        converted = convert_adapter(resolve_adapter_path(source, hub=self.hub), self.config, cache_dir=self.cache_dir,
                                    max_rank=self.max_rank)
        adapter = Adapter(name, source, converted)
        with self._lock:
            known = self._adapters.get(name)
            if known is not None and known.sha256 != adapter.sha256:
                raise AdapterError(f"adapter name {name!r} is already registered for {known.source}")
            self._adapters[name] = adapter
        return adapter

    def register_specs(self, specs: Iterable[LoraSpec]) -> list[AdapterUse]:
        """`--lora` specs registered under their stems (`spec_names`), as uses at their scales."""
        named = spec_names(specs, [a.name for a in self.adapters()])
        return [AdapterUse(self.register(name, spec.source), spec.scale) for name, spec in named]

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._adapters

    def __len__(self) -> int:
        with self._lock:
            return len(self._adapters)

    def get(self, name: str) -> Adapter:
        with self._lock:
            found = self._adapters.get(name)
            known = sorted(self._adapters)
        if found is None:
            raise UnknownAdapter(f"unknown adapter {name!r} (registered: {', '.join(known) or 'none'})")
        return found

    def adapters(self) -> list[Adapter]:
        with self._lock:
            return [self._adapters[name] for name in sorted(self._adapters)]

    def uses(self, refs: Iterable[AdapterRef]) -> tuple[AdapterUse, ...]:
        """A request's adapters as uses: each name looked up once (UnknownAdapter naming one the registry lacks).
        Names and scales were checked, and scale-0 entries dropped, when the AdapterRefs were made."""
        return tuple(AdapterUse(self.get(ref.name), ref.scale) for ref in refs)
