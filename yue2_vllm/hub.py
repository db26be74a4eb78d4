"""Model names: a local directory, or a Hugging Face Hub repo id (`m-a-p/YuE2-3B`) resolved to a snapshot.

A name that exists on disk, or that is absolute or starts with `.` or `~`, is a local path; any other
`org/name` is a repo id, fetched with `huggingface_hub.snapshot_download` (imported only then) into
the Hugging Face cache — only the files yue2-vllm reads (`ALLOW_PATTERNS`). `HF_HUB_CACHE` /
`HF_HOME`, `HF_HUB_OFFLINE` and `HF_TOKEN` are read when a name is resolved, not when
huggingface_hub was imported; a `token` or `cache_dir` given by the caller wins over them. The token is
passed to huggingface_hub only: it is in no record, message or log of ours. A partial or corrupt download
is left to the checkpoint checks that every model directory goes through.
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

# What the loaders read from a MoT or VAE repository: config, weights (single file or shards), tokenizer.
ALLOW_PATTERNS = ("config.json", "model.safetensors", "model.safetensors.index.json",
                  "model-?????-of-?????.safetensors", "weights_manifest.json", "qwen.tiktoken")
WEIGHT_PATTERNS = ("model.safetensors", "model-?????-of-?????.safetensors")
# What a Ray head reads (it loads no weights: the replicas do): the config, the tokenizer, and the files that say
# how large the weights are (upstream's weights_manifest.json, the shards' index); the rest comes from the Hub's
# metadata (`weights_bytes_of`).
HEAD_PATTERNS = tuple(pattern for pattern in ALLOW_PATTERNS if pattern not in WEIGHT_PATTERNS)
DEFAULT_REVISION = "main"
# Upstream's names for the released weights: its default model and the two decoders `--vae` names by alias.
DEFAULT_MODEL = "m-a-p/YuE2-3B"
VAE_ALIASES = {"standard": "m-a-p/YuE2-Vae", "legacy": "m-a-p/YuE2-Vae-legacy"}
DEFAULT_VAE = VAE_ALIASES["standard"]
_REPO_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_][A-Za-z0-9_.-]*")
_TRUE = {"1", "on", "yes", "true"}


class HubError(OSError):
    """A repo id that cannot be resolved (not cached while offline, not on the Hub, no network)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model directory came from: `path` is what the loaders read (a Hub snapshot for a repo id)."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None  # the revision asked for (the repo's main by default)
    commit: str | None = None  # the snapshot's commit hash
    patterns: tuple[str, ...] = ALLOW_PATTERNS  # the files asked of the Hub (HEAD_PATTERNS: no weights)
    files: tuple[str, ...] = field(default=(), compare=False)  # what the snapshot holds (a repo id only)

    def __fspath__(self) -> str:
        return str(self.path)

    def record(self) -> dict:
        """JSON for the run's records: the path read, and for a repo id the repo, revision and commit."""
        if self.repo_id is None:
            return {"path": str(Path(self.path).absolute())}
        return {"path": str(self.path), "repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}

    def fetched(self) -> dict:
        """What resolution left on this machine: `{"repo_id", "files": [name...], "bytes"}` (a repo id), or the
        local directory's path."""
        if self.repo_id is None:
            return {"path": str(Path(self.path).absolute())}
        return {"repo_id": self.repo_id, "files": list(self.files),
                "bytes": sum((Path(self.path) / name).stat().st_size for name in self.files)}


def is_repo_id(name: str) -> bool:
    """`org/name` as the Hub spells repo ids (no `--` or `..`, at most 96 characters per part)."""
    if not _REPO_ID.fullmatch(name) or "--" in name or ".." in name:
        return False
    return all(len(part) <= 96 and not part.endswith((".", "-")) for part in name.split("/"))


def is_local_name(name: str) -> bool:
    """A name read as a path: it exists, or it is absolute, `./…`, `../…` or `~…` (upstream's rule), or it
    is not shaped like a repo id."""
    return Path(name).expanduser().exists() or name.startswith((".", "~")) or Path(name).is_absolute() \
        or not is_repo_id(name)


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


def hub_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def hub_offline(env: Mapping[str, str] = os.environ) -> bool:
    return _true(env.get("HF_HUB_OFFLINE"))


@dataclass(frozen=True)
class HubOptions:
    """How repo ids are fetched, as huggingface_hub's keywords mean them: `token` (a string, False for none,
    None for `$HF_TOKEN` / the saved login), `cache_dir` (None: `hub_cache_dir()`), `local_files_only` (the
    cache only, as `HF_HUB_OFFLINE=1`), `progress` (huggingface_hub's download bars on stderr)."""

    token: str | bool | None = field(default=None, repr=False)  # never in a repr, a record or a message
    cache_dir: str | os.PathLike | None = None
    local_files_only: bool = False
    progress: bool = True


def resolve_model(name: str | os.PathLike | ModelSource, *, revision: str | None = None, what: str = "model",
                  env: Mapping[str, str] = os.environ, hub: HubOptions = HubOptions(),
                  patterns: tuple[str, ...] = ALLOW_PATTERNS) -> ModelSource:
    """A local directory as it is, or a repo id's snapshot of the files matching `patterns` (HEAD_PATTERNS for a
    process that loads no weights); errors name `what` (e.g. `--model`) and the name."""
    if isinstance(name, ModelSource):
        return name
    text = os.fspath(name)
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected a directory or a repo id, got {type(name).__name__}")
    if not isinstance(name, str) or is_local_name(text):
        if revision is not None:
            raise ValueError(f"{what} {text}: a revision ({revision!r}) applies to Hugging Face repo ids only, "
                             "not to a local directory")
        return ModelSource(Path(text).expanduser())
    return _snapshot(text, revision, what, env, hub, tuple(patterns))


def _silent_bars():
    """A tqdm class that never draws (huggingface_hub's bars when `progress` is off)."""
    from tqdm import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # huggingface_hub names its own bar groups; plain tqdm takes no name
            super().__init__(*args, **{**kwargs, "disable": True})

    return Silent


def _first_line(exc: BaseException, token) -> str:
    """The first line of huggingface_hub's message, with the token (should one be echoed) blanked out."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first.replace(token, "***") if isinstance(token, str) and token else first


def _snapshot(repo_id: str, revision: str | None, what: str, env: Mapping[str, str], hub: HubOptions,
              patterns: tuple[str, ...] = ALLOW_PATTERNS) -> ModelSource:
    from .startup import STARTUP

    with STARTUP.step("resolving", repo_id):
        return _download(repo_id, revision, what, env, hub, patterns)


def _download(repo_id: str, revision: str | None, what: str, env: Mapping[str, str], hub: HubOptions,
              patterns: tuple[str, ...]) -> ModelSource:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import constants
        from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError as exc:
        raise HubError(f"{what} {repo_id}: resolving a Hugging Face repo id needs huggingface_hub "
                       f"(pip install huggingface_hub): {exc}") from None
    cache = Path(hub.cache_dir).expanduser() if hub.cache_dir is not None else hub_cache_dir(env)
    wanted = revision or DEFAULT_REVISION
    offline = hub.local_files_only or hub_offline(env) or bool(getattr(constants, "HF_HUB_OFFLINE", False))
    token = hub.token if hub.token is not None else (env.get("HF_TOKEN") or None)
    where = f"{what} {repo_id} (revision {wanted})"
    try:
        path = snapshot_download(repo_id, revision=wanted, cache_dir=str(cache), local_files_only=offline,
                                 token=token, allow_patterns=list(patterns),
                                 **({} if hub.progress else {"tqdm_class": _silent_bars()}))
    except RevisionNotFoundError:
        raise HubError(f"{where}: the repository has no such revision") from None
    except RepositoryNotFoundError:
        raise HubError(f"{where}: no such repository on the Hugging Face Hub, or it is private or gated "
                       "(set HF_TOKEN, or pass a token, that can read it)") from None
    except LocalEntryNotFoundError as exc:
        if offline:
            switch = ("local_files_only", "drop local_files_only") if hub.local_files_only and not hub_offline(env) \
                else ("HF_HUB_OFFLINE", "unset HF_HUB_OFFLINE")
            raise HubError(f"{where}: not in the Hugging Face cache {cache} and downloads are off "
                           f"({switch[0]}); {switch[1]} to download it") from None
        first = _first_line(exc, token)
        raise HubError(f"{where}: not fully in the Hugging Face cache {cache} and the Hub cannot be reached "
                       f"({first})") from None
    except (HfHubHTTPError, OSError) as exc:
        first = _first_line(exc, token)
        raise HubError(f"{where}: download into {cache} failed ({first})") from None
    path = Path(path)
    files = tuple(sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()
                         and any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns)))
    return ModelSource(path, repo_id, wanted, path.name, tuple(patterns), files)


def weights_bytes_of(source: ModelSource, hub: HubOptions = HubOptions(), env: Mapping[str, str] = os.environ) \
        -> tuple[int, str]:
    """`(bytes, where the figure came from)` of a model's safetensors files without needing them here: the files
    themselves when present, else weights_manifest.json's per-file bytes, else the index's total_size, else the
    Hub's metadata of the repository's weight files (a HEAD_PATTERNS snapshot on a Ray head)."""
    import json

    root = Path(source.path)
    local = sorted(root.glob("*.safetensors"))
    if local or source.repo_id is None:
        return sum(p.stat().st_size for p in local), "files"
    manifest = root / "weights_manifest.json"
    if manifest.is_file():
        files = (json.loads(manifest.read_text(encoding="utf-8")) or {}).get("files") or {}
        sizes = [entry.get("bytes") for entry in files.values() if isinstance(entry, dict)]
        if sizes and all(isinstance(size, int) for size in sizes):
            return sum(sizes), "weights_manifest.json"
    index = root / "model.safetensors.index.json"
    if index.is_file():  # the shards' tensor bytes (their few-KB headers aside)
        total = ((json.loads(index.read_text(encoding="utf-8")) or {}).get("metadata") or {}).get("total_size")
        if isinstance(total, int) and total > 0:
            return total, "model.safetensors.index.json"
    try:
        return hub_weight_sizes(source.repo_id, source.commit or source.revision, hub, env), "hub metadata"
    except HubError:
        raise
    except Exception as exc:  # offline, no network, an HTTP error
        raise HubError(f"{source.repo_id}: the size of its weights is in neither weights_manifest.json nor an index, "
                       f"and the Hub's metadata could not be read ({_first_line(exc, hub.token)})") from None


def hub_weight_sizes(repo_id: str, revision: str | None, hub: HubOptions = HubOptions(),
                     env: Mapping[str, str] = os.environ) -> int:
    """Bytes of a Hub repository's weight files (WEIGHT_PATTERNS), from its file metadata (nothing downloaded)."""
    from huggingface_hub import HfApi

    token = hub.token if hub.token is not None else (env.get("HF_TOKEN") or None)
    info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, token=token)
    sizes = [sibling.size or 0 for sibling in info.siblings or ()
             if any(fnmatch.fnmatch(sibling.rfilename, pattern) for pattern in WEIGHT_PATTERNS)]
    if not sizes:
        raise HubError(f"{repo_id} (revision {revision}): the Hub lists no weight files "
                       f"({', '.join(WEIGHT_PATTERNS)})")
    return sum(sizes)
