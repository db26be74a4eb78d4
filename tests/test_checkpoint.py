import hashlib
import json
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from yue2_vllm.checkpoint import (CheckpointError, Expected, atomic_directory, check_tensors, identity, load_tensors,
                                  model_file, read_header, sha256_file, weight_index, write_bytes_atomic,
                                  write_json_atomic)


def make_dir(path, tensors, name="model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / name), metadata={"format": "pt"})
    return path


def test_header_is_read_without_data(tmp_path):
    d = make_dir(tmp_path / "m", {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.ones(2)})
    infos, metadata = read_header(d / "model.safetensors")
    assert metadata == {"format": "pt"}
    assert (infos["a"].dtype, infos["a"].shape, infos["a"].nbytes) == ("BF16", (3, 4), 24)
    assert (infos["b"].dtype, infos["b"].shape) == ("F32", (2,))
    loaded = dict(load_tensors([infos["b"]]))
    assert list(loaded) == ["b"] and torch.equal(loaded["b"], torch.ones(2))


def test_truncated_and_garbage_files(tmp_path):
    d = make_dir(tmp_path / "m", {"a": torch.zeros(100)})
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="truncated: tensor 'a' needs bytes up to 400"):
        read_header(path)
    path.write_bytes(b"\xff" * 4)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_header(path)
    path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length 1000000 does not fit"):
        read_header(path)


def test_sharded_index(tmp_path):
    d = tmp_path / "m"
    make_dir(d, {"a": torch.zeros(2)}, "model-00001-of-00002.safetensors")
    make_dir(d, {"b": torch.ones(3)}, "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(weight_index(d)) == ["a", "b"]
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"indexed tensors absent from the shards: \['b'\]"):
        weight_index(d)
    index["weight_map"]["b"] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="escapes the model directory"):
        weight_index(d)


def test_duplicate_tensor_across_shards(tmp_path):
    d = tmp_path / "m"
    make_dir(d, {"a": torch.zeros(2)}, "s1.safetensors")
    make_dir(d, {"a": torch.zeros(2), "b": torch.zeros(1)}, "s2.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="appears in both s1.safetensors and s2.safetensors"):
        weight_index(d)


def test_check_tensors_reports_everything(tmp_path):
    d = make_dir(tmp_path / "m", {"a": torch.zeros(2, dtype=torch.int8), "b": torch.zeros(3), "x": torch.zeros(1)})
    expected = {"a": Expected((2,)), "b": Expected((4,)), "c": Expected((1,))}
    with pytest.raises(CheckpointError) as info:
        check_tensors(weight_index(d), expected, "test")
    message = str(info.value)
    for part in ("missing 1: c", "unexpected 1: x", "b: shape [3]", "a: dtype I8"):
        assert part in message


def test_symlinks_and_escapes(tmp_path):
    outside = make_dir(tmp_path / "outside", {"a": torch.zeros(1)})
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(outside / "model.safetensors", d / "model.safetensors")
    with pytest.raises(CheckpointError, match="refusing a symlink"):
        weight_index(d)
    with pytest.raises(CheckpointError, match="escapes"):
        model_file(d, "/etc/passwd")


def test_hub_cache_snapshot_links_are_accepted(tmp_path):
    repo = tmp_path / "models--m-a-p--YuE2-3B"
    blob = make_dir(repo / "blobs", {"a": torch.zeros(1)}, "deadbeef")
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    os.symlink("../../blobs/deadbeef", snapshot / "model.safetensors")
    assert list(weight_index(snapshot)) == ["a"]
    assert blob.exists()


def test_sha256_and_identity(tmp_path):
    path = tmp_path / "f"
    data = os.urandom(9 * 2**20 + 7)  # spans two 8 MiB blocks
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert identity({"b": 1, "a": "é"}) == hashlib.sha256('{"a":"é","b":1}'.encode()).hexdigest()
    with pytest.raises(ValueError):
        identity({"a": float("nan")})


def test_atomic_json(tmp_path):
    path = tmp_path / "x.json"
    write_json_atomic(path, {"a": "é", "b": [1, 2]})
    assert path.read_text(encoding="utf-8") == '{\n  "a": "é",\n  "b": [\n    1,\n    2\n  ]\n}\n'
    with pytest.raises(ValueError):
        write_json_atomic(path, {"a": float("inf")})
    assert json.loads(path.read_text()) == {"a": "é", "b": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_atomic_directory_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(target) as tmp:
        (tmp / "done").write_text("x")
        assert not target.exists()
    assert (target / "done").read_text() == "x"
    with pytest.raises(FileExistsError):
        with atomic_directory(target):
            pass


def test_a_write_error_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    from yue2_vllm.checkpoint import write_bytes_atomic

    (tmp_path / "x.bin").write_bytes(b"old")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, os.strerror(28))))
    with pytest.raises(OSError, match=r"\[Errno 28\] cannot write .*x.bin: No space left on device") as info:
        write_bytes_atomic(tmp_path / "x.bin", b"new")
    assert info.value.errno == 28
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"] and (tmp_path / "x.bin").read_bytes() == b"old"


def test_an_unwritable_hash_cache_only_costs_a_rehash(tmp_path):
    from yue2_vllm.checkpoint import HashCache

    (tmp_path / "file").write_bytes(b"abc")
    (tmp_path / "not-a-dir").write_text("")
    cache = HashCache(tmp_path / "not-a-dir" / "cache.json")
    assert cache.sha256(tmp_path / "file") == hashlib.sha256(b"abc").hexdigest()


def _resident_bytes(path) -> int:
    """Bytes of `path` in the page cache now (mincore over a fresh read-only mapping; Linux)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, page = path.stat().st_size, mmap.PAGESIZE
    with open(path, "rb") as handle:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, handle.fileno(), 0)
    pages = (size + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    try:
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0, ctypes.get_errno()
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    return sum(byte & 1 for byte in vector) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore: Linux")
def test_drop_page_cache_leaves_the_loaded_files_out_of_memory(tmp_path):
    """After loading, a unified-memory machine drops the weight files' page cache (they share the GPU's pool)."""
    from yue2_vllm.checkpoint import drop_page_cache

    model = tmp_path / "model"
    model.mkdir()
    files = [model / "model-00001-of-00002.safetensors", model / "model-00002-of-00002.safetensors"]
    for index, path in enumerate(files):
        with open(path, "wb") as handle:
            handle.write(os.urandom((4 + index) * 2**20))
            handle.flush()
            os.fsync(handle.fileno())  # dirty pages are not dropped; loaded weights are clean
        path.read_bytes()
    (model / "config.json").write_text("{}")
    assert all(_resident_bytes(path) > 0 for path in files)
    assert drop_page_cache(model) == sum(path.stat().st_size for path in files) == 9 * 2**20
    assert [_resident_bytes(path) for path in files] == [0, 0]
    assert drop_page_cache(None) == 0


def test_a_file_that_cannot_be_written_names_its_directory_and_free_bytes_and_leaves_no_temp(tmp_path):
    """On a real full filesystem (a tmpfs; skipped when it cannot be mounted here)."""
    import errno

    from serving import tmpfs

    with tmpfs(tmp_path / "disk", size="1m") as mount:
        target = mount / "audio.flac"
        with pytest.raises(OSError) as raised:
            write_bytes_atomic(target, b"\0" * (2 << 20))
        assert raised.value.errno == errno.ENOSPC
        assert str(raised.value).startswith(f"[Errno 28] cannot write {target}: No space left on device ({mount} has ")
        assert str(raised.value).endswith(" bytes free)") and list(mount.iterdir()) == []
