"""The server process: one per data dir (a lock file), the socket bound before the model loads, then uvicorn.

`yue2-vllm serve` prints one JSON status line once its port is bound (`{"status": "starting", "url": ...}`, so
`--port 0` tells which port it got), one once the app serves (`{"status": "serving", ...}`) and one when it
stops. In between the first two, every request is answered 503 with what the start-up is doing
(`serve.starting`).
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..request_json import UsageError

LOG = logging.getLogger("yue2_vllm.serve")
LOCK_FILE = "server.lock"
MIN_API_KEY_CHARS = 16


def check_installed() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"yue2-vllm serve needs fastapi and uvicorn ({exc}); pip install 'yue2-vllm[serve]'") \
            from None


def api_key_from(flag: str | None) -> str | None:
    key = flag if flag is not None else os.environ.get("YUE2_API_KEY") or None
    if key is not None and (len(key) < MIN_API_KEY_CHARS or any(c.isspace() for c in key)):
        source = "--api-key" if flag is not None else "$YUE2_API_KEY"
        raise UsageError(f"{source}: must be at least {MIN_API_KEY_CHARS} characters without spaces")
    return key


@contextmanager
def data_dir_lock(data_dir: Path):
    """Hold `DATA_DIR/server.lock` (one server per data dir; the kernel drops it if the process dies)."""
    import fcntl

    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(data_dir / LOCK_FILE, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            raise UsageError(f"--data-dir {data_dir}: in use by another yue2-vllm serve (pid {owner})") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), so connections wait in the backlog while the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: {exc.strerror or exc}") from None
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_exposure(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse to listen beyond loopback without an API key (anyone who reaches the port could queue songs and
    read every job), unless the operator says so with --insecure-no-auth."""
    if is_loopback(host) or api_key is not None:
        return
    if not insecure:
        raise UsageError(f"--host {host}: listening beyond loopback needs --api-key (or $YUE2_API_KEY); "
                         "--insecure-no-auth serves without one")
    LOG.warning("serving on %s without an API key (--insecure-no-auth): anyone who reaches it can submit songs "
                "and read every job", host)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def stderr_logging() -> dict:
    """uvicorn's logging with its access log on stderr: stdout carries only our JSON status lines, and a
    supervisor that reads just the first one must not wedge the server once the pipe buffer fills."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for handler in config.get("handlers", {}).values():
        if handler.get("stream") == "ext://sys.stdout":
            handler["stream"] = "ext://sys.stderr"
    return config


@contextmanager
def one_process(args, song_setup: Callable):
    """The single-process server's workers: this process's pipeline (its weights resolved while /health says so)."""
    with song_setup(args).pipeline() as pipe:
        yield pipe, {}


@dataclass
class ClusterPlan:
    """What `serve --replicas` / `--ray-address` will run, decided before anything is written or started."""

    rules: object  # SongRules: what the ingress admits
    backend: str
    shape: object  # cluster.ReplicaShape
    concurrency: int  # songs in flight per replica
    resources: dict
    joined: bool  # an existing cluster (--ray-address), else a local one this process starts
    setup: object  # cli.setup.SongSetup: what each replica builds its pipeline from


def plan_cluster(args, song_setup: Callable) -> ClusterPlan:
    """The replicas' shape and songs in flight, refused (UsageError) when they cannot fit: on this machine's
    resources for a local cluster (none is started yet), on the joined cluster's otherwise. The flags are read once
    here, the weights resolved without their files (the replicas fetch those)."""
    from ..hub import HEAD_PATTERNS
    from .cluster import connect, local_resources, shape_replicas

    joined = args.ray_address is not None
    resources = connect(args.ray_address) if joined else local_resources()
    if args.device == "cpu":
        if args.replica_gpus:
            raise UsageError("--device cpu with --replica-gpus: CPU replicas reserve no GPU")
        resources = {**resources, "GPU": 0.0}
    shape = shape_replicas(resources, args.replicas, args.replica_gpus, args.replica_cpus, strict=not joined)
    head = song_setup(args, patterns=HEAD_PATTERNS)
    song_rules, rows = head.admission(shape.device)
    concurrency = args.concurrency or rows
    return ClusterPlan(song_rules, head.ar.backend, shape, concurrency, resources, joined,
                       head.for_replicas(concurrency))


@contextmanager
def replicas(args, plan: ClusterPlan, data_dir: Path):
    """Ray Serve replicas (the `ray` extra): the local cluster started here (or the joined one), a `ReplicaPool`
    over them, and what the status line says of them."""
    import ray

    from .cluster import ReplicaPool, connect, write_cluster_file
    from .replica import ReplicaSpec

    shape = plan.shape
    connect(args.ray_address, plan.resources)
    # Each replica builds its pipeline as this command would, with one engine row per song it serves.
    spec = ReplicaSpec(plan.setup.pipeline, str(data_dir.resolve()),
                       write_cluster_file(data_dir), plan.concurrency,
                       cpus=shape.cpus if shape.device == "cpu" else None)
    pool = ReplicaPool(plan.rules, spec, shape, backend=plan.backend, owns_cluster=not plan.joined)
    try:
        yield pool, {"replicas": shape.replicas, "replica_concurrency": plan.concurrency, "replica_gpus": shape.gpus,
                     "replica_cpus": shape.cpus, "ray_address": args.ray_address or "local",
                     "resources": plan.resources}
    finally:
        if not plan.joined:
            ray.shutdown()  # the local cluster goes with this process (a no-op once the pool has stopped it)


def uvicorn_server(config, service):
    """uvicorn's server over an app of `service`: as its shutdown begins (SIGINT / SIGTERM), before it waits for the
    open requests, every speech call waiting for its song answers and every event stream ends (`EventHub.stop`),
    so none holds the shutdown until uvicorn cuts it off."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            service.hub.stop()
            await super().shutdown(sockets=sockets)

    return Server(config)


def serve(args, song_setup: Callable, print_status: Callable[[dict], None]) -> int:
    """`yue2-vllm serve`: `song_setup(args, patterns=None)` reads the model flags once (cli.setup.SongSetup), whose
    `pipeline()` builds a pipeline; with --replicas / --ray-address each replica builds its own from what this
    process read, and this process admits songs by its `admission(device_type)` -> (SongRules, a replica's songs in
    flight unless --max-concurrency says)."""
    check_installed()
    api_key = api_key_from(args.api_key)
    check_exposure(args.host, api_key, getattr(args, "insecure_no_auth", False))
    if getattr(args, "replicas", None) is None and getattr(args, "ray_address", None) is None:
        return _serve(args, api_key, lambda data_dir: one_process(args, song_setup), print_status)
    from .cluster import check_ray

    check_ray()
    if args.device.startswith("cuda:"):
        raise UsageError(f"--device {args.device}: Ray gives each replica its GPU; use --device auto or cuda")
    with status_channel(print_status) as status:
        plan = plan_cluster(args, song_setup)
        return _serve(args, api_key, lambda data_dir: replicas(args, plan, data_dir), status)


@contextmanager
def status_channel(print_status: Callable):
    """stdout carries only our status lines, but Ray's driver prints worker errors to `sys.stdout`: while Ray runs
    in this process, `sys.stdout` is stderr and the status lines go to the real stdout."""
    real = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield lambda status: print_status(status, stream=real)
    finally:
        sys.stdout = real


def _serve(args, api_key: str | None, workers: Callable, print_status: Callable) -> int:
    """Hold the data dir, listen, build the workers (`workers(data_dir)`: a context of `(source, status words)`)
    and serve until SIGINT / SIGTERM."""
    import uvicorn

    from ..startup import STARTUP
    from .app import MAX_SSE_CLIENTS, MAX_UPLOAD_MB, create_app
    from .transcribing import QUEUE, WORKERS
    from .service import ServeConfig, SongService
    from .starting import answering_while_starting

    data_dir = Path(args.data_dir)
    try:
        with data_dir_lock(data_dir), contextlib.ExitStack() as stack:
            sock = bind(args.host, args.port)
            stack.callback(sock.close)
            STARTUP.reset()
            starting = stack.enter_context(contextlib.ExitStack())  # 503 answers until the app takes the socket
            starting.enter_context(answering_while_starting(sock, args.backend))
            print_status({"status": "starting", "url": url_of(sock), "data_dir": str(data_dir)})
            source, described = stack.enter_context(workers(data_dir))
            stack.callback(sock.close)  # on the way out, before the workers stop: no new connections wait
            service = SongService(source, ServeConfig(
                data_dir, concurrency=args.concurrency, queue_size=args.queue_size,
                stall_seconds=getattr(args, "stall_seconds", 300.0), retention_seconds=getattr(args, "retention", None),
                min_free_bytes=int(getattr(args, "min_free_disk", 1.0) * 2**30),
                max_takes=getattr(args, "max_takes", 8), speech_wait_seconds=getattr(args, "speech_timeout", 900.0),
                max_waiting_calls=getattr(args, "max_waiting_calls", 256)))
            app = create_app(service, api_key=api_key, allowed_hosts=tuple(getattr(args, "allowed_host", None) or ()),
                             max_sse_clients=getattr(args, "max_sse_clients", MAX_SSE_CLIENTS),
                             max_upload_bytes=int(getattr(args, "max_upload_mb", MAX_UPLOAD_MB) * 10**6),
                             transcription_workers=getattr(args, "transcription_workers", WORKERS),
                             transcription_queue=getattr(args, "transcription_queue", QUEUE),
                             sheetsage_device=getattr(args, "sheetsage_device", None))
            config = uvicorn.Config(app, lifespan="on", ws="none", log_config=stderr_logging(),
                                    log_level="warning" if args.quiet else "info", access_log=not args.quiet,
                                    timeout_graceful_shutdown=5, server_header=False,
                                    limit_concurrency=getattr(args, "max_connections", None))
            starting.close()  # connections from here on wait in the backlog for uvicorn
            print_status({"status": "serving", "url": url_of(sock), "data_dir": str(data_dir),
                          "backend": args.backend, **described, "concurrency": service.workers.concurrency,
                          "queue_size": args.queue_size, "api_key": api_key is not None})
            uvicorn_server(config, service).run(sockets=[sock])
    except KeyboardInterrupt:  # SIGINT / SIGTERM: uvicorn has shut down gracefully (or the model was loading)
        pass
    print_status({"status": "stopped"})
    return 0
