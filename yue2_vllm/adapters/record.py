"""One converted adapter's record (its cache entry's `conversion.json`), read once into typed fields.

vLLM reads an adapter's config once into a `PEFTHelper` and every later step asks that object; `AdapterRecord` is
ours: what was read and how, what the adapter is (half, ranks, projections), its card, and where each converted part
is. The registry's listing, result.json, the vLLM directory and doctor all read these fields; `to_dict()` is the
file as it has always been written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .checks import Summary


@dataclass(frozen=True)
class ARPart:
    """The AR part: the PEFT directory vLLM loads (`directory`), its modules, rank and target projections."""

    directory: str
    modules: int
    rank: int
    max_lora_rank: int
    target_modules: tuple[str, ...]
    scale: str = "folded into lora_B"  # where the layout's scale went

    def to_dict(self) -> dict:
        return {"directory": self.directory, "modules": self.modules, "rank": self.rank,
                "max_lora_rank": self.max_lora_rank, "target_modules": list(self.target_modules), "scale": self.scale}


@dataclass(frozen=True)
class NARPart:
    """The NAR part: the file the torch side applies, and what it holds (LoRA pairs, additive deltas, replacements)."""

    file: str
    modules: int
    pairs: int
    deltas: int
    replacements: int

    def to_dict(self) -> dict:
        return {"file": self.file, "modules": self.modules, "pairs": self.pairs, "deltas": self.deltas,
                "replacements": self.replacements}


@dataclass(frozen=True)
class AdapterRecord:
    """What one converted adapter is (see the module docstring)."""

    schema: int
    converter: str
    key: str  # the cache key: the files' sha256, the base model's shape, the converter
    sha256: str  # the content hash: a single file's own sha256 (what songs' identities hold)
    source: str  # the path it was read from
    files: Mapping[str, Mapping]  # {name relative to the adapter: {sha256, bytes}}
    layout: str
    notes: tuple[str, ...]  # how it was read: scale rule, fused splits, ...
    summary: Summary
    base: Mapping  # the base model's shape it was checked against
    ar: ARPart | None
    nar: NARPart | None
    created: str
    licence: str | None = None  # what its card's front matter declares (None: nothing)
    triggers: tuple[str, ...] = ()  # trigger words its lora.json names
    outputs: Mapping[str, str] = field(default_factory=dict)  # {converted file: sha256}, checked on reuse

    @property
    def card(self) -> dict:
        return {**({"licence": self.licence} if self.licence is not None else {}),
                **({"triggers": list(self.triggers)} if self.triggers else {})}

    @classmethod
    def from_dict(cls, data: Mapping) -> "AdapterRecord":
        summary, card, ar, nar = data["summary"], data.get("card") or {}, data.get("ar"), data.get("nar")
        return cls(
            schema=data["schema"], converter=data["converter"], key=data["key"], sha256=data["sha256"],
            source=data["source"]["path"], files=data["source"]["files"], layout=data["layout"],
            notes=tuple(data.get("notes") or ()), base=data["base"], created=data["created"],
            summary=Summary(summary["half"], summary["rank"], summary["ar_rank"], summary["modules"],
                            tuple(summary["projections"])),
            ar=None if not ar else ARPart(ar["directory"], ar["modules"], ar["rank"], ar["max_lora_rank"],
                                          tuple(ar["target_modules"]), ar["scale"]),
            nar=None if not nar else NARPart(nar["file"], nar["modules"], nar["pairs"], nar["deltas"],
                                             nar["replacements"]),
            licence=card.get("licence"), triggers=tuple(card.get("triggers") or ()),
            outputs=data.get("outputs") or {})

    def to_dict(self) -> dict:
        """conversion.json."""
        return {"schema": self.schema, "converter": self.converter, "key": self.key, "sha256": self.sha256,
                "source": {"path": self.source, "files": dict(self.files)}, "layout": self.layout,
                "notes": list(self.notes), "card": self.card, "summary": self.summary.record(), "base": dict(self.base),
                "ar": self.ar.to_dict() if self.ar else None, "nar": self.nar.to_dict() if self.nar else None,
                "created": self.created, "outputs": dict(self.outputs)}
