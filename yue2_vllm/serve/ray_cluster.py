"""Ray itself, for `serve --replicas` / `--ray-address`: whether it is installed, what a local cluster would
hold, starting or joining one (this process keeps its signal handlers), the replicas' shape on it, and the
`cluster.json` a replica reads back to know it serves this data dir. Ray is imported only when called."""
from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..request_json import UsageError

LOG = logging.getLogger("yue2_vllm.serve")
RAY_EXTRA = "pip install 'yue2-vllm[ray]'"


def check_ray() -> None:
    """Ray Serve is importable, or a UsageError naming the extra to install."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--replicas / --ray-address need Ray Serve ({exc}); install it with {RAY_EXTRA}") from None


# --------------------------------------------------------------------------- shaping the replicas


@dataclass(frozen=True)
class ReplicaShape:
    """How many replicas, and what each reserves (Ray's `num_gpus` / `num_cpus`)."""

    replicas: int
    gpus: float  # per replica: 1 on a GPU cluster (a fraction only when asked for), 0 for CPU replicas
    cpus: int  # per replica

    @property
    def device(self) -> str:
        return "cuda" if self.gpus > 0 else "cpu"

    def actor_options(self) -> dict:
        return {"num_cpus": self.cpus, **({"num_gpus": self.gpus} if self.gpus else {})}


def shape_replicas(resources: dict, replicas: int | None, gpus: float | None = None, cpus: int | None = None, *,
                   strict: bool = True) -> ReplicaShape:
    """The replicas `resources` ({"CPU", "GPU"} of a cluster) hold: one GPU each where there are GPUs (a fraction
    only when `gpus` says so), else `cpus` cores each (default: the CPUs shared out). `replicas` None: one per
    GPU, or one on a CPU cluster. A shape that cannot fit is refused (`strict`) or logged (a cluster that may
    grow)."""
    have_gpus, have_cpus = float(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    if gpus is None:
        gpus = 1.0 if have_gpus >= 1 else 0.0
    if gpus < 0 or (gpus > 1 and gpus != int(gpus)):
        raise UsageError(f"--replica-gpus {gpus:g}: must be 0 (CPU replicas), a fraction of one GPU, or whole GPUs")
    if replicas is None:
        replicas = max(1, int(have_gpus // gpus)) if gpus > 0 else 1
    if replicas < 1:
        raise UsageError(f"--replicas {replicas}: must be >= 1")
    if cpus is None:
        cpus = 1 if gpus > 0 else max(1, int(have_cpus // replicas))
    problems = []
    if replicas * gpus > have_gpus + 1e-9:
        hint = (f"; --replica-gpus {have_gpus / replicas:g} would share the GPUs (each replica then holds an engine and "
                "the torch side on its share: size --budget per replica)" if have_gpus and replicas > have_gpus
                else "")
        problems.append(f"--replicas {replicas} × {gpus:g} GPU needs {replicas * gpus:g} GPUs, the cluster has "
                        f"{have_gpus:g}{hint}")
    if replicas * cpus > have_cpus + 1e-9:
        problems.append(f"--replicas {replicas} × {cpus} CPU needs {replicas * cpus} CPUs, the cluster has "
                        f"{have_cpus:g}")
    if problems:
        if strict:
            raise UsageError("; ".join(problems))
        LOG.warning("%s: Ray starts the rest once the cluster has room", "; ".join(problems))
    return ReplicaShape(replicas, gpus, cpus)


def local_resources() -> dict:
    """What a local cluster started here would hold: this process's cores and the GPUs torch sees."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"CPU": float(cores), "GPU": float(gpus), "memory": float(memory)}


def connect(address: str | None, resources: dict | None = None) -> dict:
    """Start a local Ray cluster (`address` None: one node, `resources`' CPUs and GPUs) or join one; the
    cluster's resources. Worker output stays in Ray's logs: this process's stdout carries status lines only."""
    import ray

    if not ray.is_initialized():
        with own_signal_handlers():
            _init(ray, address, resources)
    return {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}


@contextmanager
def own_signal_handlers():
    """`ray.init` makes SIGTERM `sys.exit(15)`; this process keeps its own (the CLI's: stop gracefully, then print
    the `stopped` line and exit 0)."""
    on_main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if on_main else {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _init(ray, address: str | None, resources: dict | None) -> None:
    if address is None:
        resources = resources or local_resources()
        ray.init(address="local", num_cpus=int(resources["CPU"]), num_gpus=int(resources["GPU"]),
                 include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        return
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UsageError(f"--ray-address {address}: {exc}") from None


def cluster_nodes() -> list[dict]:
    import ray

    return [{"host": node.get("NodeManagerHostname"), "alive": node.get("Alive"),
             "resources": {k: v for k, v in node.get("Resources", {}).items() if k in ("CPU", "GPU", "memory")}}
            for node in ray.nodes()]


def write_cluster_file(data_dir: Path) -> str:
    """`DATA_DIR/cluster.json` with a fresh token: a replica that reads it back sees this data dir."""
    from ..checkpoint import write_json_atomic
    from .replica import CLUSTER_FILE

    token = secrets.token_hex(16)
    write_json_atomic(data_dir / CLUSTER_FILE, {"token": token, "ingress": socket.gethostname(),
                                                 "pid": os.getpid(), "started": time.time()})
    return token
