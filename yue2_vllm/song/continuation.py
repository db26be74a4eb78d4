"""Continuing a capped song: the song the same request with a longer `seconds` would have made.

A finished song whose semantic phase was cut by its cap (`truncated.semantic`) can go on: the new song's request is
the parent's with the new `seconds` (and the parent's sampling, so that its configuration is the one the longer
request would have had), its plan is the parent's (copied: a cap changes no score), and its semantic phase goes on
from the parent's codes on the backend that made them (song/stages.py; the vLLM engine prefills them, from its
prefix cache while it still holds their blocks; the torch backend replays them through its decode steps and
restores its generator). Synthesis and decode then render the whole song afresh: one noise draw and the NAR's
chunks over its full length, as the longer request would have. The parent's directory is only read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import artifacts as art
from ..checkpoint import json_text, read_json
from ..model.sampling import ARContinuation
from ..protocol import (CODEC_OFFSET, CODEC_SIZE, GenerationConfig, SongRequest, check_seconds, seconds_for_tokens,
                        seconds_tokens, tokens_seconds)

RNG_FILE = "semantic_rng.npy"  # the torch backend's generator state after a capped song's last token
CONTINUE_KEY = "continue"  # a song's overrides under it name the capped song it continues: {"directory", ...}
# Effective-config keys a continuation must share with its parent: the generation settings besides the sampling.
SHARED_GENERATION = ("ode_steps", "ode_method", "context", "version")
# Effective-config keys that change the tokens: a continuation with others differs from the longer song.
TOKEN_CONFIG = ("quantization", "ar_checkpoint", "dtype", "kv_cache_dtype")
ENGINE_CONFIG = ("ar_checkpoint", "kv_cache_dtype")  # the vLLM engine's alone: no torch-backend token depends on them


class ContinueRefused(ValueError):
    """A song that cannot be continued (unfinished, not capped, another model, ...); the message is one line."""


@dataclass
class ParentSong:
    """A finished, capped song read from its run directory: what a continuation needs of it."""

    directory: Path
    request: SongRequest  # as it ran (its `seconds`: the cap that cut it, or None: semantic max_tokens did)
    identity: str
    tokens: list[int]  # the codec indices it made
    config: dict  # its effective config (config.json)
    weights: dict
    semantic_timing: dict  # its semantic phase's record (backend, execution, batch invariance)
    plan_files: dict[str, bytes]  # the plan stage's files, verified against its record
    plan_meta: dict
    rng_state: bytes | None = None
    name: str = ""  # what refusals call the song (default: its directory)
    adapters: list = field(default_factory=list)  # result.json's `adapters`: name, sha256, scale, source, ... each

    def __post_init__(self):
        self.name = self.name or str(self.directory)

    @property
    def seconds(self) -> float:
        return tokens_seconds(len(self.tokens))

    def overrides(self) -> dict:
        """Per-phase sampling that gives the continued request the parent's: the abc phase's as it ran, the
        semantic phase's but its max_tokens (the new `seconds` is the budget)."""
        generation = self.config["generation"]
        semantic = {k: v for k, v in generation["semantic"].items() if k != "max_tokens"}
        return {"abc": dict(generation["abc"]), "semantic": semantic}

    def generation_config(self, child: SongRequest) -> GenerationConfig:
        """The generation config the song was made with, as its config.json records it, for its continuation
        `child`: the semantic phase's budget is the child's (a song's `seconds` cap is no setting of the config)."""
        generation = dict(self.config["generation"])
        semantic = {**generation["semantic"], "max_tokens": seconds_tokens(child.seconds)}
        return GenerationConfig.from_dict({**generation, "semantic": semantic})

    def adapter_sources(self) -> list[tuple[str, str]]:
        """`(name, source)` of each adapter the song ran with, as its result.json records them (songs made before
        the record named sources: none; their adapters must be registered again by name)."""
        return [(entry["name"], entry["source"]) for entry in self.adapters if entry.get("source")]

    def instrumental_adapter(self) -> str | None:
        """The name of the adapter an instrumental song was rendered with (its recipe), None for any other song."""
        chosen = self.config.get("instrumental_adapter") or {}
        return next((entry["name"] for entry in self.adapters if entry.get("sha256") == chosen.get("sha256")), None)

    def child_request(self, seconds: float, song_id: str | None = None) -> SongRequest:
        """The parent's request with the longer `seconds` (and a new id: `<parent id>.<seconds>s` by default)."""
        seconds = check_seconds(seconds)
        cap = seconds_tokens(seconds)
        if cap <= len(self.tokens):
            raise ContinueRefused(f"seconds: {seconds:g} caps the song at {cap} tokens, and it has {len(self.tokens)} "
                                  f"({self.seconds:g} s) already; ask for more than "
                                  f"{seconds_for_tokens(len(self.tokens)):g} seconds")
        return replace(self.request, seconds=seconds, id=song_id or continued_id(self.request.id, seconds))

    def ar_continuation(self) -> ARContinuation:
        timing = self.semantic_timing
        return ARContinuation([t + CODEC_OFFSET for t in self.tokens], self.rng_state, timing.get("rng_device"),
                              timing.get("backend_actual"))

    def child_plan(self, child: SongRequest) -> tuple[dict[str, bytes], dict]:
        """The plan stage of the continued song: the parent's files and meta; an instrumental's planning and render
        requests (in its record and instrumental.json) with the child's id and `seconds`, as the longer request
        writes them."""
        files, meta = dict(self.plan_files), dict(self.plan_meta)
        record = meta.get("instrumental")
        if record:
            record = dict(record)
            for key in ("planning_request", "render_request"):
                if record.get(key) is not None:  # the song's own request with its recipe's changes: id, seconds too
                    steps = {**record[key], "id": child.id}
                    steps.pop("seconds", None)
                    record[key] = {**steps, **({"seconds": child.seconds} if child.seconds is not None else {})}
            meta["instrumental"] = record
            files["instrumental.json"] = (json_text(record, indent=2) + "\n").encode("utf-8")
        return files, meta

    def record(self) -> dict:
        """What the continued song's result.json says of its parent."""
        return {"id": self.request.id, "identity": self.identity, "directory": str(self.directory),
                "semantic_tokens": len(self.tokens), "seconds": self.request.seconds,
                "backend": self.semantic_timing.get("backend_actual")}


def continued_id(song_id: str, seconds: float) -> str:
    """`<id>.<seconds>s`, the parent's id shortened to keep within the 180-character limit."""
    suffix = f".{seconds:g}s"
    return song_id[:180 - len(suffix)] + suffix


def read_parent(directory: str | os.PathLike, name: str | None = None) -> ParentSong:
    """The finished, capped song in `directory`; ContinueRefused (one line, `continue: <name>: ...`; the name
    defaults to the directory) for anything else."""
    path = Path(directory)
    name = name or str(path)
    result = path / art.RESULT_FILE
    if not path.is_dir():
        raise ContinueRefused(f"continue: {name}: is not a song's directory")
    if not result.is_file():
        state = (art.RunDirectory(path).state() or {}).get("state")
        raise ContinueRefused(f"continue: {name}: holds no finished song (no {art.RESULT_FILE}"
                              + (f"; its run is {state}" if state else "") + "); finish it first (--resume)")
    try:
        document = art.verify_result(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ContinueRefused(f"continue: {name}: is not a finished song that verifies: {exc}") from None
    truncated = document.get("truncated") or {}
    if not truncated.get("semantic"):
        raise ContinueRefused(f"continue: {name}: the song ended by itself (</music>) after "
                              f"{(document.get('audio_seconds') or 0):.2f} s; only a song its cap cut can continue")
    run = art.RunDirectory(path)
    plan = _stage(run, "plan", name)
    semantic = _stage(run, "semantic", name)
    try:
        request = SongRequest.from_dict(read_json(path / "request.json"))
        config = read_json(path / "config.json")
        tokens = art.load_npy(path / "semantic.npy").astype(int).tolist()
        plan_files = {name: (path / name).read_bytes() for name in plan["files"]}
        rng = art.load_npy(path / RNG_FILE).tobytes() if (path / RNG_FILE).is_file() else None
    except (OSError, ValueError, TypeError) as exc:
        raise ContinueRefused(f"continue: {name}: cannot read the song ({exc})") from None
    if any(not 0 <= t < CODEC_SIZE for t in tokens):
        raise ContinueRefused(f"continue: {name}: its semantic.npy holds ids outside the codec range")
    return ParentSong(path, request, document["identity"], tokens, config, document.get("weights") or {},
                      dict(semantic["meta"].get("timing") or {}), plan_files, dict(plan["meta"]), rng, name,
                      list(document.get("adapters") or []))


def _stage(run: art.RunDirectory, stage: str, name: str) -> dict:
    record = art.read_stage_record(run.path, stage)
    if record is None:
        raise ContinueRefused(f"continue: {name}: its {stage} stage record is missing or unreadable")
    return record


def check_continuable(parent: ParentSong, weights: dict, generation: GenerationConfig, directory: Path) -> None:
    """Refuse (one line naming the problem) a continuation this pipeline cannot make into `directory`."""
    if weights.get("mot") != parent.weights.get("mot"):
        raise ContinueRefused(f"continue: {parent.name}: the song was made by another model (its MoT weights "
                              "differ from this pipeline's); continue it with the model that made it")
    asked = generation.to_dict()
    had = parent.config.get("generation") or {}
    for key in SHARED_GENERATION:
        if key in had and had[key] != asked[key]:
            raise ContinueRefused(f"continue: {parent.name}: the song was made with {key} {had[key]!r}, this "
                                  f"pipeline runs {asked[key]!r}; continue it with the same generation config")
    target = Path(os.path.abspath(directory))
    source = Path(os.path.abspath(parent.directory))
    if target == source or source in target.parents:
        raise ContinueRefused(f"continue: {parent.name}: the continued song is a new song; write it outside its "
                              "directory (another --output or --id)")


def check_adapters(parent: ParentSong, adapters) -> None:
    """Refuse (one line naming it) a continuation whose adapters (`adapters`: the continued song's AdapterRequest,
    as its pipeline resolved them) are not the ones the song was made with: one of its adapters registered with
    other contents, or another instrumental recipe or adapter than the song was rendered with. (An adapter the
    registry lacks is refused by name when the song is checked.)"""
    uses = {use.adapter.name: use.adapter for use in adapters.uses}
    for entry in parent.adapters:
        registered = uses.get(entry.get("name"))
        if registered is not None and registered.sha256 != entry.get("sha256"):
            raise ContinueRefused(f"continue: {parent.name}: adapter {entry['name']!r} ({registered.source}) is not "
                                  f"the one the song was made with (sha256 {registered.sha256[:12]}, the song's "
                                  f"{str(entry.get('sha256'))[:12]}); continue it with the adapter it was made with")
    had = parent.config.get("instrumental_adapter")
    has = adapters.instrumental.identity() if adapters.instrumental is not None else None
    if had != has:
        recipe = "upstream's instrumental recipe (no instrumental adapter)"
        made = (f"instrumental adapter {parent.instrumental_adapter() or '?'!r} (sha256 {str(had.get('sha256'))[:12]})"
                if had else recipe)
        runs = (f"instrumental adapter {adapters.instrumental.adapter.name!r} (sha256 "
                f"{adapters.instrumental.adapter.sha256[:12]})" if has else recipe)
        raise ContinueRefused(f"continue: {parent.name}: the song was rendered with {made}, this pipeline renders "
                              f"it with {runs}; continue it with the instrumental adapter it was made with")


def exactness(parent: ParentSong, config: dict, timing: dict) -> dict:
    """Whether the continued song is token for token (and so sample for sample) the song its request makes from
    the start, and why not where it is not (or not shown)."""
    made, went = parent.semantic_timing.get("backend_actual"), timing.get("backend_actual")
    if made != went:
        return {"exact": False, "why": f"the song's semantic phase ran on {made}, its continuation on {went}: "
                                       "another sampler and arithmetic"}
    differs = [key for key in TOKEN_CONFIG if parent.config.get(key) != config.get(key)
               and not (went == "torch" and key in ENGINE_CONFIG)]  # a torch song continued by a vLLM pipeline
    if differs:
        return {"exact": False, "why": f"the song was made with other {', '.join(differs)}"}
    if went == "torch":
        execution = timing.get("execution")
        if parent.semantic_timing.get("execution") != execution:
            return {"exact": False, "why": f"the song decoded {parent.semantic_timing.get('execution')}, its "
                                           f"continuation {execution}: other arithmetic"}
        if execution == "eager":
            return {"exact": True, "why": "torch backend, eager: the codes were replayed through the same decode "
                                          "steps (each attends over the used keys only) and the generator went on "
                                          "from its saved state"}
        if timing.get("attention") == "sdpa_masked":
            return {"exact": False, "why": f"torch backend, {execution} with sdpa_masked: each step attends over a "
                                           "K/V buffer sized by the phase's budget, which can round differently, so "
                                           "a capped song need not be the longer song's beginning "
                                           "(--torch-execution eager makes it so)"}
        return {"exact": None, "why": f"torch backend, {execution} with {timing.get('attention')}: the codes were "
                                      "replayed and the generator restored, but that a step's arithmetic does not "
                                      "depend on the budget-sized K/V buffer is not shown on this GPU kind"}
    invariant = parent.semantic_timing.get("batch_invariant") and timing.get("batch_invariant")
    if not invariant:
        return {"exact": False, "why": "the vLLM engine was not batch-invariant (--reproducible): a bf16 song's "
                                       "tokens may depend on the songs sharing its steps, and a prefill's on its "
                                       "chunking"}
    how = timing.get("batch_invariance") or ""
    if how.startswith("float32"):
        return {"exact": True, "why": f"vLLM, {how}: the codes were prefilled and the sampler, keyed by position, "
                                      "went on where it stopped; a float32 prefill of them gives the logits their "
                                      "decode gave (tests/test_song_continuation.py)"}
    return {"exact": None, "why": f"vLLM, {how}: the sampler goes on where it stopped, but that a prefill of the "
                                  "codes gives the logits their decode gave is not shown on this GPU kind"}
