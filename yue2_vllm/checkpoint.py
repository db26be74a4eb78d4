"""Checkpoint I/O: lazy safetensors reading, validation, identities and atomic writes.

Everything here works on headers first: a model directory is checked (names, shapes,
dtypes, byte ranges, file containment) before a single tensor is read, and tensors are
then read one at a time from memory-mapped files.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
HASH_CHUNK_BYTES = 8 * 2**20

# safetensors dtype tag -> (bytes per element, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "BOOL": (1, torch.bool),
    "U8": (1, torch.uint8),
    "I8": (1, torch.int8),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "F8_E5M2": (1, torch.float8_e5m2),
    "I16": (2, torch.int16),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I32": (4, torch.int32),
    "F32": (4, torch.float32),
    "I64": (8, torch.int64),
    "F64": (8, torch.float64),
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


class CheckpointError(ValueError):
    """A model directory or weight file is unusable; the message names what and where."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype tag, shape and byte range in the data section."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    data_offset: int = 0  # where the file's data section begins (8 + header length)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


# --------------------------------------------------------------------------- paths


def _is_hub_blob_link(path: Path) -> bool:
    """huggingface_hub snapshots link `snapshots/<rev>/<file>` to `../../blobs/<hash>`."""
    snapshot = path.parent
    repo = snapshot.parent.parent
    if snapshot.parent.name != "snapshots":
        return False
    blobs = (repo / "blobs").resolve()
    return path.resolve().parent == blobs


def model_dir_path(model_dir: str | os.PathLike) -> Path:
    """`model_dir` as a Path, after checking it is an existing directory."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: " + ("is not a directory" if root.exists()
                                             else "model directory does not exist"))
    return root


def model_file(model_dir: str | os.PathLike, name: str) -> Path:
    """Resolve `name` inside `model_dir`, refusing escapes and foreign symlinks.

    A name must be a relative path that stays inside the directory. A symlink is accepted
    only when it is a Hugging Face cache snapshot link into the same repository's blobs.
    """
    root = model_dir_path(model_dir)
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or name in ("", "."):
        raise CheckpointError(f"{root}: file name {name!r} escapes the model directory")
    path = root / relative
    if path.is_symlink() and not _is_hub_blob_link(path):
        raise CheckpointError(f"{path}: refusing a symlink in a model directory (copy the file instead)")
    resolved_root = root.resolve()
    if not path.is_symlink() and resolved_root not in path.resolve().parents:
        raise CheckpointError(f"{path}: resolves outside the model directory {resolved_root}")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing file")
    return path


# --------------------------------------------------------------------------- headers


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check one safetensors header without reading tensor data.

    Returns `(tensors, metadata)`. Every byte range is checked against the file size, so a
    truncated download is reported here, naming the file and the first tensor cut off.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: not a safetensors file ({size} bytes)")
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(
                f"{path}: header length {header_len} does not fit the {size}-byte file (truncated or not safetensors)")
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has invalid shape {list(shape)}")
        expected = math.prod(shape) * DTYPES[dtype][0]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end and end - start == expected):
            raise CheckpointError(
                f"{path}: tensor {name!r} byte range [{start}, {end}) does not hold {dtype}{list(shape)}")
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {end} but the data section has {data_size}")
        tensors[name] = TensorInfo(name, path, dtype, shape, start, end, 8 + header_len)
    return tensors, metadata


def weight_index(model_dir: str | os.PathLike) -> dict[str, TensorInfo]:
    """All tensors of a model directory (single file or sharded with an index), headers only."""
    root = model_dir_path(model_dir)
    if (root / INDEX_FILE).exists():
        index = read_json(model_file(root, INDEX_FILE))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{root / INDEX_FILE}: missing a non-empty 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE_FILE).exists() or (root / SINGLE_FILE).is_symlink():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        found, _ = read_header(model_file(root, name))
        for key, info in found.items():
            if key in tensors:
                raise CheckpointError(f"{root}: tensor {key!r} appears in both {tensors[key].file.name} and {name}")
            if weight_map is not None and weight_map.get(key) != name:
                raise CheckpointError(f"{root / INDEX_FILE}: tensor {key!r} is in {name} but the index says "
                                      f"{weight_map.get(key)!r}")
            tensors[key] = info
    if weight_map is not None and set(weight_map) - set(tensors):
        missing = sorted(set(weight_map) - set(tensors))
        raise CheckpointError(f"{root / INDEX_FILE}: indexed tensors absent from the shards: {missing[:10]}")
    return tensors


@dataclass(frozen=True)
class Expected:
    """What a checkpoint must hold for one tensor name."""

    shape: tuple[int, ...]
    dtypes: frozenset[str] = FLOAT_DTYPES


def check_tensors(found: Mapping[str, TensorInfo], expected: Mapping[str, Expected], what: str) -> None:
    """Compare a header index with the expected layout and report every problem at once."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing {len(missing)}: " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: " + ", ".join(unexpected[:20])
                        + (" ..." if len(unexpected) > 20 else ""))
    for name in sorted(set(found) & set(expected)):
        info, want = found[name], expected[name]
        if info.shape != want.shape:
            problems.append(f"{name}: shape {list(info.shape)} in {info.file.name}, expected {list(want.shape)}")
        if info.dtype not in want.dtypes:
            problems.append(f"{name}: dtype {info.dtype} in {info.file.name}, expected one of {sorted(want.dtypes)}")
    if problems:
        raise CheckpointError(f"{what}: " + "; ".join(problems))


def load_tensors(infos: Iterable[TensorInfo], *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` one at a time, reading only the requested tensors.

    Files are memory-mapped by safetensors, so peak memory is one tensor plus the caller's.
    """
    from safetensors import safe_open

    by_file: dict[Path, list[TensorInfo]] = {}
    for info in infos:
        by_file.setdefault(info.file, []).append(info)
    for path, group in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for info in sorted(group, key=lambda i: i.start):
                tensor = handle.get_tensor(info.name)
                if dtype is not None and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                yield info.name, tensor.to(device)


def tensor_blocks(info: TensorInfo, block_bytes: int = HASH_CHUNK_BYTES) -> Iterator[bytes]:
    """A tensor's raw bytes from its file, block by block."""
    with open(info.file, "rb") as handle:
        handle.seek(info.data_offset + info.start)
        remaining = info.nbytes
        while remaining:
            block = handle.read(min(block_bytes, remaining))
            if not block:
                raise CheckpointError(f"{info.file}: ended inside tensor {info.name!r}")
            yield block
            remaining -= len(block)


def write_safetensors_subset(infos: Iterable[TensorInfo], path: str | os.PathLike,
                             metadata: dict[str, str] | None = None, on_block=None) -> str:
    """Write a safetensors file holding exactly these tensors, byte-identical, copied block by block;
    `on_block(nbytes)` hears each block before it is written (and may raise to stop the copy)."""
    def blocks(info: TensorInfo):
        for block in tensor_blocks(info):
            if on_block is not None:
                on_block(len(block))
            yield block

    return write_safetensors_tensors(path, [(info.name, info.dtype, info.shape, lambda info=info: blocks(info))
                                            for info in infos], metadata)


# --------------------------------------------------------------------------- identities


def sha256_file(path: str | os.PathLike, on_block=None) -> str:
    """sha256 of a file, streamed in 8 MiB blocks; `on_block(nbytes)` hears each (and may raise to stop)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(HASH_CHUNK_BYTES):
            if on_block is not None:
                on_block(len(block))
            digest.update(block)
    return digest.hexdigest()


def canonical_json(value) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False)


def identity(value) -> str:
    """sha256 of the canonical JSON form of a value (upstream's request/derivation identity)."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- atomic writes


def read_json(path: str | os.PathLike):
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write to `<name>.<pid>.tmp` beside the target, fsync, then rename into place.

    On any error the temp file is removed and the target is untouched; an OSError (e.g. ENOSPC)
    is re-raised naming the target file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}{free_space_note(path, exc)}") from None
        raise


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException) -> bool:
    """Whether an error is a full disk (or quota): space returning makes the same write work."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem of `path` (its nearest existing parent), None when it cannot be read."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def free_space_note(path: Path, exc: BaseException) -> str:
    """" (DIR has N bytes free)" for a full disk, else ""."""
    if not disk_full(exc):
        return ""
    free = free_bytes(path.parent)
    return f" ({path.parent} has {free if free is not None else 'an unknown number of'} bytes free)"


def fsync_directory(path: str | os.PathLike) -> None:
    """Make the renames into a directory durable (its entries, not only the files' bytes)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory descriptors
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def json_text(value, indent: int | None = None) -> str:
    """JSON as readable UTF-8 text; a string that is not valid Unicode (a lone surrogate) makes it
    fall back to \\u escapes rather than fail to encode."""
    text = json.dumps(value, indent=indent, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, indent=indent, allow_nan=False)
    return text


def json_bytes(value) -> bytes:
    return (json_text(value, indent=2) + "\n").encode("utf-8")


def write_json_atomic(path: str | os.PathLike, value) -> None:
    write_bytes_atomic(path, json_bytes(value))


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary sibling name and rename it into place on success.

    The target must not exist (or be an empty directory). On any error the temporary
    directory is removed, so a reader never sees a half-written result.
    """
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target}: already exists and is not an empty directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the result should look like any new directory
    try:
        yield tmp
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- model identities

WEIGHTS_MANIFEST = "weights_manifest.json"


def cache_root() -> Path:
    """yue2-vllm's own cache (hash cache, tiny default): `$YUE2_VLLM_CACHE` or `~/.cache/yue2-vllm`."""
    return Path(os.environ.get("YUE2_VLLM_CACHE") or Path.home() / ".cache" / "yue2-vllm")


class HashCache:
    """sha256 of large files remembered by (resolved path, size, mtime_ns), so 7 GB are hashed once.

    The cache is a JSON file written atomically; a changed size or mtime invalidates an entry.
    """

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path is not None else None

    def _entries(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            entries = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return {}  # a damaged cache only costs a re-hash
        return entries if isinstance(entries, dict) else {}

    def remember(self, file: Path, digest: str) -> None:
        """Record a digest computed elsewhere (e.g. while writing the file)."""
        if self.path is None:
            return
        stat = file.stat()
        entries = self._entries()
        entries[str(file.resolve())] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, entries)
        except OSError:
            pass  # e.g. a full disk: an unsaved entry only costs a re-hash next time

    def sha256(self, file: Path, *, verify: bool = False, on_block=None) -> str:
        stat = file.stat()
        key = str(file.resolve())
        stamp = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        entries = self._entries()
        cached = entries.get(key)
        if not verify and isinstance(cached, dict) and all(cached.get(k) == v for k, v in stamp.items()):
            return cached["sha256"]
        digest = sha256_file(file, on_block)
        if verify and isinstance(cached, dict) and cached.get("bytes") == stat.st_size \
                and cached.get("sha256") not in (None, digest):
            raise CheckpointError(f"{file}: sha256 {digest} differs from the recorded {cached['sha256']} "
                                  "although size and mtime match (the file changed in place)")
        self.remember(file, digest)
        return digest


def default_hash_cache() -> HashCache:
    """The hash cache every command shares, in yue2-vllm's own cache."""
    return HashCache(cache_root() / "sha256-cache.json")


def weights_bytes(model_dir: str | os.PathLike | None) -> int:
    """Bytes of a model directory's safetensors files (0 for no directory)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) if model_dir is not None else 0


def drop_page_cache(model_dir: str | os.PathLike | None) -> int:
    """Ask the kernel to drop the page cache of a model directory's safetensors files (after they are loaded:
    `posix_fadvise(POSIX_FADV_DONTNEED)`), so that on unified memory the cached file pages do not stand in the
    engine's way. Only clean pages no mapping still holds are dropped; returns the bytes of the files advised
    (0 where the platform has no posix_fadvise)."""
    if model_dir is None or not hasattr(os, "posix_fadvise"):
        return 0
    advised = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return advised


def model_identity(model_dir: str | os.PathLike, *, hashes: HashCache | None = None, verify: bool = False,
                   on_block=None) -> dict:
    """`{"files": {name: {sha256, bytes}}, "config_sha256"}` over the directory's safetensors files.

    With `verify`, every file is re-hashed; a `weights_manifest.json` beside the weights, when
    present, must agree with the file set and hashes.
    """
    root = model_dir_path(model_dir)
    hashes = hashes or HashCache(None)
    files = {}
    for path in sorted(root.glob("*.safetensors")):
        path = model_file(root, path.name)
        files[path.name] = {"sha256": hashes.sha256(path, verify=verify, on_block=on_block),
                            "bytes": path.stat().st_size}
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files")
    manifest_path = root / WEIGHTS_MANIFEST
    if manifest_path.exists():
        recorded = (read_json(model_file(root, WEIGHTS_MANIFEST)) or {}).get("files", {})
        if set(recorded) != set(files):
            raise CheckpointError(f"{manifest_path}: lists {sorted(recorded)} but the directory has {sorted(files)}")
        for name, entry in files.items():
            if recorded[name].get("sha256") != entry["sha256"]:
                raise CheckpointError(f"{root / name}: sha256 does not match {WEIGHTS_MANIFEST}")
    config = model_file(root, "config.json")
    return {"files": files, "config_sha256": sha256_file(config)}


def write_safetensors_tensors(path: str | os.PathLike, entries, metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file from `(name, dtype tag, shape, produce)` entries, one tensor at a time.

    The header is built from the declared names, dtype tags and shapes before any data exists;
    then each `produce()` is called once, in entry order, and returns that tensor's bytes: a
    bytes-like object, a CPU tensor of the declared dtype and shape, or an iterable of byte
    blocks. Peak memory is therefore one tensor (or one block), not the file. Every entry's
    byte count is checked against its declaration. Returns the sha256 of the written file.
    """
    entries = list(entries)
    header, offset, sizes = {}, 0, []
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError(f"{path}: safetensors metadata must map strings to strings")
        header["__metadata__"] = metadata
    for name, dtype, shape, _ in entries:
        if name == "__metadata__" or name in header:
            raise CheckpointError(f"{path}: tensor name {name!r} is reserved or repeated")
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        shape = [int(d) for d in shape]
        size = math.prod(shape) * DTYPES[dtype][0]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        sizes.append(size)
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        def emit(block) -> int:
            out.write(block)
            digest.update(block)
            return memoryview(block).nbytes

        emit(struct.pack("<Q", len(raw)) + raw)
        for (name, dtype, shape, produce), size in zip(entries, sizes):
            data = produce()
            if isinstance(data, torch.Tensor):
                if data.dtype != DTYPES[dtype][1] or tuple(data.shape) != tuple(shape):
                    raise CheckpointError(f"{path}: tensor {name!r} was declared {dtype}{list(shape)} but produced "
                                          f"{data.dtype}{list(data.shape)}")
                data = [data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()]
            elif isinstance(data, (bytes, bytearray, memoryview)):
                data = [data]
            written = sum(emit(block) for block in data)
            if written != size:
                raise CheckpointError(f"{path}: tensor {name!r} produced {written} bytes, its header says {size}")
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()
