"""One song's adapters, resolved once when the song is admitted, and the registered adapters they come from.

`ServedAdapters.resolve(request)` turns a request's AdapterRefs (names and scales were checked, and scale-0 ones
dropped, when the request was made) into an `AdapterRequest`: each adapter's record and scale, the instrumental
adapter its recipe adds, and the engine's reference to their AR parts (`engine.lora.LoraRequest`, our counterpart of
vLLM's LoRARequest; several AR adapters stacked as one, `adapters.stacks`). The song carries that object to every
stage and face: its identity (`config`: each adapter's content hash and scale, never its name), result.json
(`record`), the AR phases on vLLM (`prepared_lora`: a stacked or scaled directory is made when the song runs, never
while it is checked) or on the torch backend (`ar_edits`, as run-time edits: `model.lora`), and the NAR
(`nar_edits`: the AR parts for its prefix prefill, so the NAR attends to the adapted keys and values, and the NAR
parts for its velocity).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from ..adapters.registry import AdapterRegistry, AdapterUse
from ..adapters.stacks import ar_target, make_ar_directory, stack_rank
from ..adapters.weights import AdapterError
from ..engine.lora import LoraIds, LoraRequest, LoraSettings
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
class AdapterRequest:
    """The adapters one song runs with, resolved once (empty: the base model). `own` are the request's, in its
    order; `instrumental` the instrumental adapter its recipe runs with (`AdapterOptions.instrumental`; the request's
    own entry of that name when it names it); `lora_request` what the vLLM engine runs their AR parts as (None: no
    AR part, or a song for the torch backend)."""

    own: tuple[AdapterUse, ...] = ()
    instrumental: AdapterUse | None = None
    lora_request: LoraRequest | None = None

    @property
    def uses(self) -> tuple[AdapterUse, ...]:
        """What the song runs with: its own, then the instrumental adapter where the recipe adds it (the render
        request's adapters)."""
        added = self.instrumental
        if added is None or any(use.adapter.name == added.adapter.name for use in self.own):
            return self.own
        return (*self.own, added)

    def __bool__(self) -> bool:
        return bool(self.uses)

    @property
    def ar_uses(self) -> list[AdapterUse]:
        return [use for use in self.uses if use.adapter.converted.ar_path is not None]

    def ar_edits(self) -> Edits | None:
        """The torch AR backend's edits (the AR parts; None: none)."""
        uses = self.ar_uses
        return _merged([use.adapter.converted.edits(use.scale, "ar") for use in uses]) if uses else None

    def nar_edits(self) -> Edits | None:
        """The NAR stage's edits: every part (the AR ones serve its prefix prefill; None: no adapter)."""
        return _merged([use.adapter.converted.edits(use.scale) for use in self.uses]) if self else None

    def prepared_lora(self) -> LoraRequest | None:
        """`lora_request` with its directory made (a stack's, or one adapter's at a scale other than 1: once, when
        the song first runs on the engine)."""
        if self.lora_request is not None:
            make_ar_directory([(use.adapter.converted, use.scale) for use in self.ar_uses],
                              Path(self.lora_request.path))
        return self.lora_request

    def config(self) -> dict:
        """What the song's effective config (its identity) holds of its adapters: `adapters` (content hash, scale
        and half of its own, in the request's order) and, for the instrumental recipe, its adapter's hash and scale;
        nothing without any, so every other song keeps the identity it always had."""
        config = {}
        if self.own:
            config["adapters"] = [{**use.identity(), "half": use.adapter.half} for use in self.own]
        if self.instrumental is not None:
            config.update(instrumental_recipe="adapter", instrumental_adapter=self.instrumental.identity())
        return config

    def record(self) -> list[dict]:
        """result.json's `adapters`: name, half, content hash, scale, rank, layout and licence of each it ran with, and
        where it was registered from (`source`: a Hub id, or a local path made absolute; what a continuation
        registers)."""
        return [{**use.record(), "source": recorded_source(use.adapter.source)} for use in self.uses]


@dataclass
class ServedAdapters:
    """A pipeline's registry with what its engine was started with: the LoRA settings and the ids vLLM knows its
    adapters by; `resolve` makes a song's AdapterRequest."""

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

    def resolve(self, request, *, engine: bool) -> AdapterRequest:
        """The song's adapters (see the module docstring): each name looked up once (UnknownAdapter naming one the
        registry lacks); with `engine` (its AR phases may run on vLLM) also the LoraRequest their AR parts run as,
        where a stack above the engine's `max_lora_rank` is refused, naming the adapters. Writes nothing."""
        own = self.registry.uses(request.adapters)
        song = AdapterRequest(own, self._instrumental(request, own))
        if engine and song.ar_uses:
            song = replace(song, lora_request=self._lora_request(song))
        return song

    def _instrumental(self, request, own: tuple[AdapterUse, ...]) -> AdapterUse | None:
        """The instrumental adapter an instrumental request runs with (the registered one, scale 1, unless the
        request names it with a scale); None for any other request and for an instrumental one with a given score
        (upstream's recipe edits that score)."""
        name = self.options.instrumental
        if name is None or not request.instrumental or request.abc is not None:
            return None
        return next((use for use in own if use.adapter.name == name), None) or AdapterUse(self.registry.get(name))

    def _lora_request(self, song: AdapterRequest) -> LoraRequest:
        uses = [(use.adapter.converted, use.scale) for use in song.ar_uses]
        rank = stack_rank(uses)
        if rank > self.lora.max_lora_rank:
            names = " + ".join(use.adapter.name for use in song.ar_uses)
            raise AdapterError(f"adapters {names}: their AR parts stack to rank {rank}, above the engine's "
                               f"max_lora_rank {self.lora.max_lora_rank} (register with a larger max_lora_rank)")
        path = ar_target(uses, self.options.cache_dir)
        key = uses[0][0].sha256 if len(uses) == 1 else path.name
        return self.ids.request(key, uses[0][1] if len(uses) == 1 else 1.0, path)
