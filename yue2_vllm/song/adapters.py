"""One song's adapters: the registered adapters its request names, and what each side of the song gets of them.

The AR parts go to vLLM as one LoRA per request (`engine.lora.LoraSlot`; several AR adapters stacked,
`adapters.stacks`) or, on the torch AR backend, as run-time edits (`model.lora`); the NAR stage gets every part:
the AR ones for its prefix prefill (so the NAR attends to the adapted keys and values) and the NAR ones for its
velocity. What enters the song's identity is each adapter's content hash and scale (`config`), never its name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..adapters.registry import AdapterRegistry, AdapterUse
from ..adapters.stacks import ar_directory, stack_rank
from ..adapters.weights import AdapterError
from ..engine.lora import LoraIds, LoraSettings, LoraSlot
from ..model.lora import Edits
from ..options import AdapterOptions


def recorded_source(source: str) -> str:
    """An adapter's source as a record keeps it: a local path absolute (it stays findable from another directory),
    a Hub repo id as given."""
    local = Path(source).expanduser()
    return str(local.resolve()) if local.exists() else source


def _merged(parts: Sequence[Edits]) -> Edits:
    edits: dict[str, list] = {}
    for part in parts:
        for module, module_edits in part.items():
            edits.setdefault(module, []).extend(module_edits)
    return edits


@dataclass(frozen=True)
class SongAdapters:
    """The adapters one song runs with, at their scales (empty: the base model)."""

    uses: tuple[AdapterUse, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.uses)

    @property
    def ar_uses(self) -> list[AdapterUse]:
        return [use for use in self.uses if use.adapter.converted.ar_path is not None]

    def ar_edits(self) -> Edits:
        """The torch AR backend's edits (the AR parts)."""
        return _merged([use.adapter.converted.edits(use.scale, "ar") for use in self.ar_uses])

    def nar_edits(self) -> Edits:
        """The NAR stage's edits: every part (the AR ones serve its prefix prefill)."""
        return _merged([use.adapter.converted.edits(use.scale) for use in self.uses])

    def config(self) -> list[dict]:
        """What the song's identity holds of its adapters: content hash, scale and half, in the request's order."""
        return [{"sha256": use.adapter.sha256, "scale": use.scale, "half": use.adapter.half} for use in self.uses]

    def record(self) -> list[dict]:
        """result.json's `adapters`: name, half, rank, layout, licence, content hash and scale of each, and where it
        was registered from (`source`: a Hub id, or a local path made absolute; what a continuation registers)."""
        return [{**use.record(), "rank": use.adapter.converted.summary["rank"],
                 "layout": use.adapter.converted.record["layout"],
                 "licence": use.adapter.converted.record["card"].get("licence"),
                 "source": recorded_source(use.adapter.source)} for use in self.uses]


@dataclass
class ServedAdapters:
    """A pipeline's registry with what its engine was started with: the LoRA settings and the ids vLLM knows its
    adapters by."""

    registry: AdapterRegistry
    options: AdapterOptions
    lora: LoraSettings = LoraSettings()
    ids: LoraIds = field(default_factory=LoraIds)

    @classmethod
    def register(cls, options: AdapterOptions, config) -> "ServedAdapters":
        """Register every `options.modules` adapter (read, checked, converted: AdapterError naming the first that
        fails, before anything loads). The LoRA the engine runs for them is the resolved options' (resolved.py:
        `ResolvedOptions.with_adapters`), set on the result by the pipeline."""
        registry = AdapterRegistry(config, cache_dir=options.cache_dir,
                                   **({"max_rank": options.max_lora_rank} if options.max_lora_rank else {}))
        for name, source in options.modules:
            registry.register(name, source)
        return cls(registry, options)

    def listing(self) -> dict:
        """`{name: info}` of every registered adapter (what SongRules admits and GET /v1/adapters lists)."""
        return {adapter.name: adapter.info() for adapter in self.registry.adapters()}

    def instrumental_for(self, request):
        """The AdapterRef an instrumental request runs with (the registered instrumental adapter, scale 1), None for
        any other request and for an instrumental one with a given score (upstream's recipe edits that score)."""
        from ..protocol import AdapterRef

        name = self.options.instrumental
        if name is None or not request.instrumental or request.abc is not None:
            return None
        return next((ref for ref in request.adapters if ref.name == name), AdapterRef(name))

    def for_song(self, request) -> SongAdapters:
        """The song's adapters (UnknownAdapter naming one the registry lacks)."""
        return SongAdapters(tuple(self.registry.uses(request.adapters, "adapters")))

    def lora_slot(self, song: SongAdapters) -> LoraSlot | None:
        """The vLLM adapter a song's AR phases carry (None: no AR part); a stack above the engine's
        `max_lora_rank` is refused, naming the adapters."""
        uses = [(use.adapter.converted, use.scale) for use in song.ar_uses]
        if not uses:
            return None
        rank = stack_rank(uses)
        if rank > self.lora.max_lora_rank:
            names = " + ".join(use.adapter.name for use in song.ar_uses)
            raise AdapterError(f"adapters {names}: their AR parts stack to rank {rank}, above the engine's "
                               f"max_lora_rank {self.lora.max_lora_rank} (register with a larger max_lora_rank)")
        path = ar_directory(uses, self.options.cache_dir)
        key = uses[0][0].sha256 if len(uses) == 1 else path.name
        return self.ids.slot(key, uses[0][1] if len(uses) == 1 else 1.0, path)
