"""A song worker as a Ray Serve replica, and the job board through which the ingress reaches replicas.

Imported only on the Ray paths (`yue2-vllm serve --replicas N` / `--ray-address ADDR`; `pip install
'yue2-vllm[ray]'`). One replica holds what a single-process server holds — a pipeline, its resident engine and
the synthesis lane (`SongWorker`) — and runs one attempt of a job per `run` call, streaming the song's events
back to the ingress as plain dicts (progress coalesced to a few a second) until its final event.

The ingress cannot address one replica through Serve's router, so what must reach the replica that runs a job
goes through the `JobBoard`, an actor of the ingress: cancel requests (a replica long-polls the board for each
run it holds) and the replicas' load reports (every second: songs in flight, engine state, problems).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray
from ray import serve

from ..scheduler import FINAL_STATES, SongEvent
from .worker import SongOrder, SongWorker

LOG = logging.getLogger("yue2_vllm.serve")
CLUSTER_FILE = "cluster.json"  # written by the ingress into the data dir; every replica must read it back
PROGRESS = ("tokens", "nar", "vae")
REPORT_SECONDS = 1.0
CANCEL_POLL_SECONDS = 10.0


class DataDirUnreachable(RuntimeError):
    """This replica does not see the data dir the ingress uses (it would write songs nobody can serve)."""


def check_data_dir(data_dir: str | os.PathLike, token: str, where: str) -> None:
    """Refuse a replica that cannot read the ingress's `cluster.json` (same token) or write into `jobs/`: on
    several nodes the data dir must be one shared file system, mounted at the same path on every node."""
    data_dir = Path(data_dir)
    advice = ("every replica reads and writes the ingress's data dir: on a multi-node cluster it must be a shared "
              "file system (NFS, a cluster file system) mounted at the same path on every node")
    try:
        seen = json.loads((data_dir / CLUSTER_FILE).read_text(encoding="utf-8")).get("token")
    except (OSError, ValueError) as exc:
        raise DataDirUnreachable(f"replica on {where} cannot see the data dir {data_dir} ({exc}); {advice}") from None
    if seen != token:
        raise DataDirUnreachable(f"replica on {where}: {data_dir}/{CLUSTER_FILE} is another server's (its token "
                                 f"differs), so this node's {data_dir} is not the ingress's; {advice}")
    probe = data_dir / "jobs" / f".probe-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise DataDirUnreachable(f"replica on {where} cannot write into {data_dir}/jobs ({exc}); {advice}") from None


def pin_cpus(cores: int, local_rank: int) -> list[int]:
    """Keep this replica (and the engine worker it starts) on its own `cores` of this node's CPUs: replicas on
    one node must not share cores (two OpenMP pools on one core slow both down several-fold)."""
    available = sorted(os.sched_getaffinity(0))
    if cores >= len(available):
        return available
    start = (local_rank * cores) % len(available)
    mine = [available[(start + i) % len(available)] for i in range(cores)]
    for task in os.listdir("/proc/self/task"):  # every thread of the process (Linux pins threads one by one)
        try:
            os.sched_setaffinity(int(task), mine)
        except (ProcessLookupError, PermissionError):  # a thread that has just ended
            pass
    return mine


def collapse(events: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Events in order, each run of progress events of one kind (and phase) kept as its last one — except a
    first step (done == 1), which the SSE stream shows as it comes."""
    out: list[tuple[str, dict]] = []
    for kind, data in events:
        if out and kind in PROGRESS and out[-1][0] == kind and out[-1][1].get("phase") == data.get("phase") \
                and out[-1][1].get("done") != 1:
            out[-1] = (kind, data)
        else:
            out.append((kind, data))
    return out


async def coalesced(inbox: asyncio.Queue, interval: float):
    """`(kind, data)` from `inbox` as they come, progress collapsed to at most one batch per `interval` s."""
    pending: list[tuple[str, dict]] = []
    flush_at = 0.0
    loop = asyncio.get_running_loop()
    while True:
        timeout = None if not pending else max(0.0, flush_at - loop.time())
        try:
            item = await asyncio.wait_for(inbox.get(), timeout)
        except asyncio.TimeoutError:
            for event in collapse(pending):
                yield event
            pending = []
            continue
        items = [item]
        while not inbox.empty():
            items.append(inbox.get_nowait())
        for kind, data in items:
            if kind in PROGRESS:
                if not pending:
                    flush_at = loop.time() + interval
                pending.append((kind, data))
                continue
            for event in collapse(pending):
                yield event
            pending = []
            yield kind, data


@ray.remote(num_cpus=0, max_concurrency=10_000)
class JobBoard:
    """The ingress's side channel to its replicas: cancel flags per run, load reports per replica."""

    def __init__(self):
        self._cancelled: set[str] = set()
        self._waiters: dict[str, asyncio.Event] = {}
        self._reports: dict[str, dict] = {}

    async def cancel(self, run_id: str) -> None:
        self._cancelled.add(run_id)
        if run_id in self._waiters:
            self._waiters[run_id].set()

    async def is_cancelled(self, run_id: str) -> bool:
        return run_id in self._cancelled

    async def wait_cancel(self, run_id: str, timeout: float) -> bool:
        """True once the run is cancelled; False after `timeout` seconds without (ask again)."""
        if run_id in self._cancelled:
            return True
        event = self._waiters.setdefault(run_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def forget(self, run_id: str) -> None:
        self._cancelled.discard(run_id)
        waiter = self._waiters.pop(run_id, None)
        if waiter is not None:
            waiter.set()

    async def report(self, replica: str, load: dict) -> None:
        self._reports[replica] = {**load, "received": time.time()}

    async def drop(self, replica: str) -> None:
        self._reports.pop(replica, None)

    async def reports(self) -> dict:
        return dict(self._reports)


@dataclass
class ReplicaSpec:
    """What every replica is built from (pickled to the replicas by Serve)."""

    build_pipeline: Callable  # () -> YuE2Pipeline: the ingress's SongSetup.pipeline, as a single process builds its own
    data_dir: str
    token: str  # the ingress's cluster.json token: the replica proves it sees the same data dir
    concurrency: int  # songs in flight in this replica (= the deployment's max_ongoing_requests)
    cpus: int | None = None  # pin the replica to this many of its node's cores (CPU replicas); None: no pinning
    event_interval: float = 0.1  # progress events of a run are sent at most this often


class SongReplica:
    """The Serve deployment class (see the module docstring); `serve.cluster` deploys it."""

    def __init__(self, spec: ReplicaSpec, board):
        self.spec, self.board = spec, board
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        rank = getattr(context, "rank", None)
        local_rank = getattr(rank, "local_rank", 0) if rank is not None else 0
        self.where = {"replica": self.name, "host": socket.gethostname(), "pid": os.getpid(),
                      "node": ray.get_runtime_context().get_node_id()[:12], "rank": getattr(rank, "rank", 0)}
        check_data_dir(spec.data_dir, spec.token, f"{self.where['host']} (node {self.where['node']}, replica "
                                                  f"{self.name})")
        if spec.cpus:
            self.where["cpus"] = pin_cpus(spec.cpus, local_rank)
        self.pipe = spec.build_pipeline()
        self.where["device"] = str(self.pipe.device)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.worker = SongWorker(self.pipe, concurrency=spec.concurrency, listener=self._on_event)
        self.worker.start()
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report, name="yue2-replica-report", daemon=True)
        self._reporter.start()
        LOG.info("replica %s on %s ready: %s", self.name, self.where["host"], self.where)

    # -- one run of a job

    async def run(self, order: dict):
        """Run one attempt of a job; yields `{"kind", "data"}`: `accepted` (where it runs), the song's events,
        and its final event (see `serve.worker`)."""
        order = SongOrder(**order)
        yield {"kind": "accepted", "data": dict(self.where)}
        unable = self.fatal()
        if unable is not None:  # Serve routes here until the health check fails: the song goes elsewhere
            yield {"kind": "failed", "data": {**self._not_here(unable), "refused": True}}
            return
        if await self.board.is_cancelled.remote(order.run_id):
            yield {"kind": "cancelled", "data": {"error": {"type": "Cancelled", "message": "cancelled before it "
                                                                                              "started"},
                                                 "result": None, "engine_failure": False}}
            return
        inbox: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if order.job_id in self._streams:
                raise RuntimeError(f"job {order.job_id} is already running on replica {self.name}")
            self._streams[order.job_id] = (asyncio.get_running_loop(), inbox)
        handle, watcher = None, None
        try:
            handle = self.worker.submit(order)
            watcher = asyncio.create_task(self._watch_cancel(order.run_id, handle))
            async for kind, data in coalesced(inbox, self.spec.event_interval):
                yield {"kind": kind, "data": data}
                if kind in FINAL_STATES:
                    return
        finally:
            with self._lock:
                self._streams.pop(order.job_id, None)
            if watcher is not None:
                watcher.cancel()
            if handle is not None and not handle.done:  # the ingress went away: the song stops at its next boundary
                handle.cancel()

    def _not_here(self, reason: str) -> dict:
        """A final event's data for a song this replica cannot serve any more: the ingress puts it back, as it does
        for a song whose replica died."""
        return {"error": {"type": "ReplicaUnavailable", "message": f"replica {self.name} on {self.where['host']}: "
                                                                   f"{reason}", "replica": self.name},
                "result": None, "engine_failure": False, "replica_lost": True}

    def _on_event(self, event: SongEvent) -> None:
        """The worker's listener (song and lane threads): hand the event to its run's stream."""
        stream = self._streams.get(event.song.id)
        if stream is None:
            return
        loop, inbox = stream
        data = event.data
        if event.kind == "failed" and data.get("engine_failure"):
            unable = self.worker.down_for_good()
            if unable is not None:  # the engine will not come back here: not the song's fault, nor its last try
                data = self._not_here(unable)
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, (event.kind, data))
        except RuntimeError:  # the run's event loop is gone
            pass

    async def _watch_cancel(self, run_id: str, handle) -> None:
        while not handle.done:
            try:
                cancelled = await self.board.wait_cancel.remote(run_id, CANCEL_POLL_SECONDS)
            except Exception:  # noqa: BLE001 (the board is the ingress's: it is gone, so is whoever asked)
                LOG.warning("replica %s: the ingress's job board is gone; stopping %s", self.name, run_id)
                cancelled = True
            if cancelled:
                handle.cancel()
                return

    # -- health and load

    def load(self) -> dict:
        return {**self.where, **self.worker.health(), "fatal": self.fatal(), "at": time.time()}

    def fatal(self) -> str | None:
        """Why this replica cannot serve any more (Serve then replaces it), else None."""
        down = self.worker.down_for_good()
        if down is not None:
            return down
        if not self.worker.scheduler.healthy:
            return "the torch side is not running (a song or synthesis thread has stopped)"
        return None

    def check_health(self) -> None:
        reason = self.fatal()
        if reason is not None:
            raise RuntimeError(f"replica {self.name}: {reason}")

    def _report(self) -> None:
        while not self._stop.is_set():
            try:
                ray.get(self.board.report.remote(self.name, self.load()), timeout=10)
            except Exception:  # noqa: BLE001 (the next report may get through)
                LOG.debug("replica %s: load report failed", self.name, exc_info=True)
            self._stop.wait(REPORT_SECONDS)

    def __del__(self):
        """Serve's graceful shutdown: stop the songs at their next boundary, then the engine."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.close(timeout=10)
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            pipe.close()
