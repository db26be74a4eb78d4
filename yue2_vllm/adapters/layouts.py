"""Read an adapter as users bring it (a file, a directory, a directory per half) into `weights.AdapterWeights`.

Where the scale comes from, per module (first found): the module's own `.alpha` tensor; the safetensors
metadata (`alpha`, `lora_alpha`, kohya's `ss_network_alpha`, ntc-ai's `conceptmod` record); the config file
(`adapter_config.json`'s PEFT `lora_alpha` with `alpha_pattern`, or its `alpha`/`rank` form; `lora.json`); else
alpha = rank, scale 1.0 (the rule of the suffix-less released files: "W += lora_B @ lora_A, scale 1.0").
The scale is alpha / rank, or alpha / √rank with rsLoRA (`use_rslora`). Where a config or the metadata
declares the rank, every pair must have it (PEFT's `rank_pattern` may name others); ComfyUI/kohya files may
mix ranks, each module with its own alpha.

`LAYOUTS` names what was read (recorded with the conversion and shown by GET /v1/adapters).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import peft_format as peft
from ..checkpoint import CheckpointError, load_tensors, read_header
from ..model.modeling import YuE2Config
from .fused import split_pair, split_rows
from .halves import halves
from .keys import Key, parse_key, refusal, unfused
from .weights import AdapterError, AdapterWeights, Diff, Full, Pair

LAYOUTS = ("plain", "peft", "alpha-rank", "lora.json", "comfyui", "slider-distill")
PEFT_CONFIG, LORA_JSON, CARD = peft.CONFIG, "lora.json", "README.md"  # alpha-rank configs share PEFT's name
WEIGHT_NAMES = (peft.WEIGHTS, "lora.safetensors")
SLIDER_FORMAT, PARTICLE_FORMAT = "conceptmod-yue2-ar-v1", "conceptmod-yue2-routed-particle-ar-v1"
# PEFT settings whose adapters are not a plain LoRA delta on the base weights: (key, refusing value test, what).
PEFT_REFUSED = (
    ("use_dora", bool, "DoRA (use_dora) is not a plain LoRA delta"),
    ("lora_bias", bool, "LoRA bias (lora_bias) is not supported"),
    ("bias", lambda v: v not in (None, "none"), "adapter bias (bias != 'none') is not supported"),
    ("layer_replication", bool, "layer_replication is not supported"),
    ("use_qalora", bool, "QALoRA is not supported"),
    ("init_lora_weights", lambda v: isinstance(v, str) and v.lower() not in ("gaussian", "eva", "orthogonal", "mica",
                                                                            "lora_ga"),
     "an init that changes the base weights (PiSSA, OLoRA, CorDA, LoftQ) is not supported"),
)


@dataclass
class ScaleRule:
    """What a config (or the file's metadata) says about the scale."""

    source: str | None = None  # the file or "metadata" it came from
    kind: str | None = None  # peft, alpha-rank, lora.json, metadata, slider
    rank: int | None = None  # the declared rank
    alpha: float | None = None
    rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    triggers: list[str] = field(default_factory=list)

    def declared(self, module: str) -> tuple[int | None, float | None]:
        """The rank and alpha this rule gives `module` (PEFT's patterns: a suffix of the name at a dot boundary)."""
        rank, alpha = self.rank, self.alpha
        for pattern, value in self.rank_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                rank = value
                break
        for pattern, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                alpha = value
                break
        return rank, alpha


def _number(value, where: str, what: str, integer: bool = False):
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise AdapterError(f"{where}: {what} {value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
            or (integer and value != int(value)):
        raise AdapterError(f"{where}: {what} must be a positive {'integer' if integer else 'number'}, got {value!r}")
    return int(value) if integer else float(value)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path}: must hold a JSON object")
    return data


def peft_rule(path: Path) -> ScaleRule:
    """An `adapter_config.json`: PEFT's `r` / `lora_alpha` (with rsLoRA and the patterns) or the `alpha` / `rank`
    form of the Space installers."""
    data = _read_json(path)
    if data.get("peft_type") not in (None, "LORA"):
        raise AdapterError(f"{path}: peft_type {data['peft_type']!r} is not LoRA")
    for key, refused, what in PEFT_REFUSED:
        if key in data and refused(data[key]):
            raise AdapterError(f"{path}: {what}")
    if "r" in data or "lora_alpha" in data:
        rank = _number(data.get("r", 8), str(path), "r", integer=True)
        patterns = {}
        for key in ("rank_pattern", "alpha_pattern"):
            value = data.get(key) or {}
            if not isinstance(value, dict):
                raise AdapterError(f"{path}: {key} must be an object")
            patterns[key] = {str(k): _number(v, str(path), f"{key}[{k!r}]", integer=key == "rank_pattern")
                             for k, v in value.items()}
        return ScaleRule(str(path), "peft", rank, _number(data.get("lora_alpha", 8), str(path), "lora_alpha"),
                         bool(data.get("use_rslora")), patterns["rank_pattern"], patterns["alpha_pattern"])
    if "alpha" in data or "rank" in data:
        rank = _number(data["rank"], str(path), "rank", integer=True) if "rank" in data else None
        alpha = _number(data["alpha"], str(path), "alpha") if "alpha" in data else None
        return ScaleRule(str(path), "alpha-rank", rank, alpha, bool(data.get("use_rslora")))
    raise AdapterError(f"{path}: holds neither PEFT's r / lora_alpha nor alpha / rank")


def lora_json_rule(path: Path) -> ScaleRule:
    """A `lora.json` beside one safetensors file: alpha (or lora_alpha), rank (or r), rsLoRA, trigger words."""
    data = _read_json(path)
    alpha = data.get("alpha", data.get("lora_alpha"))
    rank = data.get("rank", data.get("r"))
    triggers = data.get("triggers", data.get("trigger_words", data.get("trigger", [])))
    triggers = [triggers] if isinstance(triggers, str) else [str(t) for t in triggers or () if isinstance(t, str)]
    return ScaleRule(str(path), "lora.json", None if rank is None else _number(rank, str(path), "rank", integer=True),
                     None if alpha is None else _number(alpha, str(path), "alpha"), bool(data.get("use_rslora")),
                     triggers=triggers)


def metadata_rule(path: Path, metadata: dict[str, str]) -> ScaleRule | None:
    """What a safetensors file's `__metadata__` says: ntc-ai's `conceptmod` record, or an alpha (and rank)."""
    where = f"{path} (__metadata__)"
    if "conceptmod" in metadata:
        try:
            record = json.loads(metadata["conceptmod"])
        except json.JSONDecodeError:
            raise AdapterError(f"{where}: its conceptmod record is not JSON") from None
        if not isinstance(record, dict):
            raise AdapterError(f"{where}: its conceptmod record is not an object")
        if record.get("format") == PARTICLE_FORMAT:
            raise AdapterError(f"{path}: a routed-particle slider ({PARTICLE_FORMAT}): not LoRA (a routed MLP per "
                               "projection); use its rank-8 distill")
        if record.get("format") != SLIDER_FORMAT:
            raise AdapterError(f"{where}: unknown conceptmod format {record.get('format')!r}")
        return ScaleRule(where, "slider", _number(record.get("rank"), where, "rank", integer=True),
                         _number(record.get("alpha"), where, "alpha"))
    alpha = next((metadata[k] for k in ("alpha", "lora_alpha", "ss_network_alpha") if k in metadata), None)
    rank = next((metadata[k] for k in ("rank", "ss_network_dim") if k in metadata), None)
    if alpha is None and rank is None:
        return None
    return ScaleRule(where, "metadata", None if rank is None else _number(rank, where, "rank", integer=True),
                     None if alpha is None else _number(alpha, where, "alpha"),
                     metadata.get("use_rslora", "").lower() == "true")


# --------------------------------------------------------------------------- where the files are


@dataclass(frozen=True)
class Part:
    """One weights file and the config file that goes with it (None: the file alone)."""

    weights: Path
    config: Path | None = None


def _weights_of(directory: Path) -> list[Path]:
    pickles = sorted(p.name for p in directory.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    files = sorted(directory.glob("*.safetensors"))
    if not files and pickles:
        raise AdapterError(f"{directory}: only pickled weights ({', '.join(pickles)}); convert them to safetensors "
                           "(pickles can run code when loaded and are not read)")
    return files


def locate(path: Path) -> list[Part]:
    """The parts of an adapter at `path`: a safetensors file; a directory with `adapter_config.json` (its
    `adapter_model.safetensors` or `lora.safetensors`) or `lora.json` (its one safetensors file) or one
    safetensors file; or a directory of such directories, one per half."""
    if not path.exists():
        raise AdapterError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise AdapterError(f"{path}: not a .safetensors file (pickled .bin/.pt weights are not read)")
        return [Part(path)]
    files = _weights_of(path)
    for config_name in (PEFT_CONFIG, LORA_JSON):
        config = path / config_name
        if not config.is_file():
            continue
        named = [path / name for name in WEIGHT_NAMES if (path / name).is_file()] if config_name == PEFT_CONFIG else []
        chosen = named[:1] or files
        if len(chosen) != 1:
            raise AdapterError(f"{path}: {config_name} needs exactly one safetensors file beside it, found "
                               f"{[p.name for p in files] or 'none'}")
        return [Part(chosen[0], config)]
    if len(files) == 1:
        return [Part(files[0])]
    if files:
        raise AdapterError(f"{path}: holds {len(files)} adapter files ({', '.join(p.name for p in files)}); "
                           "name the one to use")
    inner = [d for d in sorted(path.iterdir()) if d.is_dir() and not d.name.startswith(".")
             and ((d / PEFT_CONFIG).is_file() or (d / LORA_JSON).is_file() or any(d.glob("*.safetensors")))]
    if not inner:
        raise AdapterError(f"{path}: no adapter files (.safetensors) in it")
    return [part for d in inner for part in locate(d)]


def read_card(directory: Path) -> dict:
    """`{"licence": …}` from a README.md's YAML front matter (`license:`), when there is one."""
    card = directory / CARD
    try:
        text = card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    match = re.match(r"---\s*\n(.*?)\n---", text, re.S)
    found = match and re.search(r"^license:\s*['\"]?([^'\"\n]+?)['\"]?\s*$", match.group(1), re.M)
    return {"licence": found.group(1)} if found else {}


# --------------------------------------------------------------------------- reading


def _alpha_value(tensor, path: Path, key: str) -> float:
    if tensor.numel() != 1:
        raise AdapterError(f"{path}: tensor {key}: an alpha must hold one number, got shape {list(tensor.shape)}")
    return _number(float(tensor.float().reshape(())), f"{path}: tensor {key}", "alpha")


def _group(path: Path, names) -> tuple[dict[str, dict[str, str]], set[str], set[str]]:
    """`{module: {role: key}}` of a file's tensor names, the key forms and the container hints seen."""
    groups: dict[str, dict[str, str]] = {}
    forms, hints = set(), set()
    for name in names:
        what = refusal(name)
        if what:
            raise AdapterError(f"{path}: tensor {name}: {what}")
        try:
            key: Key = parse_key(name)
        except KeyError as exc:
            raise AdapterError(f"{path}: tensor {name}: unknown key ({exc.args[0]})") from None
        roles = groups.setdefault(key.module, {})
        if key.role in roles:
            raise AdapterError(f"{path}: tensor {name}: {key.module} is given twice (also by {roles[key.role]})")
        roles[key.role] = name
        forms.add(key.form)
        hints.add(key.hint)
    return groups, forms, hints - {None}


def _kind(roles: dict[str, str], module: str, path: Path) -> str:
    lora, diff, full = {"a", "b", "alpha"} & set(roles), {"diff", "diff_b"} & set(roles), {"weight", "bias"} & set(roles)
    if sum(map(bool, (lora, diff, full))) > 1:
        raise AdapterError(f"{path}: tensor {sorted(roles.values())[0]}: {module} mixes LoRA factors, deltas and "
                           "replacement tensors")
    if lora:
        for role, other in (("a", "b"), ("b", "a")):
            if role not in roles:
                raise AdapterError(f"{path}: tensor {roles[other] if other in roles else roles['alpha']}: "
                                   f"{module} has no lora_{'A' if role == 'a' else 'B'} (missing key)")
        return "pair"
    return "diff" if diff else "full"


def _scale(rule: ScaleRule, tensor_alpha: float | None, module: str, rank: int, path: Path, key: str) -> float:
    declared_rank, alpha = rule.declared(module)
    if declared_rank is not None and declared_rank != rank:
        raise AdapterError(f"{path}: tensor {key}: rank {rank}, but {rule.source} declares rank {declared_rank} "
                           "(mixed ranks)")
    alpha = tensor_alpha if tensor_alpha is not None else alpha if alpha is not None else rank
    return alpha / math.sqrt(rank) if rule.rslora else alpha / rank


def read_part(part: Part, config: YuE2Config) -> tuple[dict, set[str], set[str], ScaleRule, list[str]]:
    """`(modules, forms, hints, rule, notes)` of one weights file (fused modules split onto their projections)."""
    path = part.weights
    try:
        infos, metadata = read_header(path)
    except CheckpointError as exc:
        raise AdapterError(str(exc)) from None
    from_metadata = metadata_rule(path, metadata)
    rule = (peft_rule(part.config) if part.config is not None and part.config.name == PEFT_CONFIG else
            lora_json_rule(part.config) if part.config is not None else None)
    if rule is None or from_metadata is not None and from_metadata.kind == "slider":
        rule = from_metadata or ScaleRule()
    elif from_metadata is not None and from_metadata.alpha is not None:
        rule.alpha, rule.source = from_metadata.alpha, from_metadata.source
    if not infos:
        raise AdapterError(f"{path}: holds no tensors")
    groups, forms, hints = _group(path, infos)
    tensors = dict(load_tensors(infos.values()))
    sizes = {"q_proj": config.num_attention_heads * config.head_dim, "k_proj": config.num_key_value_heads * config.head_dim,
             "v_proj": config.num_key_value_heads * config.head_dim, "gate_proj": config.intermediate_size,
             "up_proj": config.intermediate_size}
    modules, notes, split = {}, [], 0
    for module, roles in sorted(groups.items()):
        kind = _kind(roles, module, path)
        parts = unfused(module)
        part_sizes = [sizes[p.rsplit(".", 1)[-1]] for p in parts] if parts else None
        if kind == "pair":
            a, b = tensors[roles["a"]], tensors[roles["b"]]
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
                raise AdapterError(f"{path}: tensor {roles['b']}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                                   "are not a [rank, in] / [out, rank] pair")
            alpha = _alpha_value(tensors[roles["alpha"]], path, roles["alpha"]) if "alpha" in roles else None
            scale = _scale(rule, alpha, module, a.shape[0], path, roles["a"])
            keys = (roles["a"], roles["b"])
            if parts:
                try:
                    pieces = split_pair(a, b, part_sizes)
                except ValueError as exc:
                    raise AdapterError(f"{path}: tensor {roles['b']}: {exc}") from None
                modules.update({name: Pair(pa, pb, scale, keys, path) for name, (pa, pb) in zip(parts, pieces)})
                split += 1
            else:
                modules[module] = Pair(a, b, scale, keys, path)
            continue
        names = ("diff", "diff_b") if kind == "diff" else ("weight", "bias")
        weight, bias = (tensors.get(roles.get(role)) for role in names)
        keys = tuple(roles.get(role) for role in names)
        make = Diff if kind == "diff" else Full
        if parts:
            try:
                pieces = zip(split_rows(weight, part_sizes), split_rows(bias, part_sizes))
            except ValueError as exc:
                raise AdapterError(f"{path}: tensor {keys[0] or keys[1]}: {exc}") from None
            modules.update({name: make(w, b_, keys, path) for name, (w, b_) in zip(parts, pieces)})
            split += 1
        else:
            modules[module] = make(weight, bias, keys, path)
    if split:
        notes.append(f"{path.name}: {split} fused qkv_proj / gate_up_proj split by rows onto their projections")
    if rule.rslora:
        notes.append(f"{path.name}: rsLoRA scale alpha / sqrt(rank)")
    return modules, forms, hints, rule, notes


def layout_name(forms: set[str], hints: set[str], rules: list[ScaleRule]) -> str:
    """The container's name where it has a config file, else the key form's."""
    kinds = {rule.kind for rule in rules}
    for kind in ("lora.json", "peft", "alpha-rank"):
        if kind in kinds:
            return kind
    if hints:
        return "comfyui"
    return "slider-distill" if "slider" in forms else "plain"


def read_adapter(path: str | Path, config: YuE2Config) -> AdapterWeights:
    """The adapter at `path`, read and normalized (not yet checked against the base: `checks.check_adapter`)."""
    path = Path(path).expanduser()
    parts = locate(path)
    modules: dict = {}
    forms, hints, rules, notes, files = set(), set(), [], [], []
    owners: dict[str, Path] = {}
    for part in parts:
        found, part_forms, part_hints, rule, part_notes = read_part(part, config)
        if len(parts) > 1:
            if not found:
                raise AdapterError(f"{part.weights}: holds no modules")
            half = halves(found)
            clash = [p for h, p in owners.items() if h == half or "both" in (h, half)]
            if clash:
                raise AdapterError(f"{path}: {part.weights.parent.name} and {clash[0].parent.name} both adapt the "
                                   f"{half.upper() if half != 'both' else 'same'} half; name the directory to use")
            owners[half] = part.weights
        modules.update(found)
        forms |= part_forms
        hints |= part_hints
        rules.append(rule)
        notes += part_notes
        files += [part.weights] + ([part.config] if part.config else [])
    card = read_card(path if path.is_dir() else path.parent)
    triggers = [t for rule in rules for t in rule.triggers]
    if triggers:
        card["triggers"] = triggers
    layout = layout_name(forms, hints, rules)
    scales = sorted({round(c.scale, 6) for c in modules.values() if isinstance(c, Pair)})
    if scales:
        notes.insert(0, f"layout {layout}; LoRA scale {' / '.join(map(str, scales[:4]))}"
                        + (" (alpha = rank: no config)" if layout == "plain" and scales == [1.0] else ""))
    return AdapterWeights(path, layout, tuple(files), modules, notes, card)
