"""Scale-out on Ray Serve: the job service's workers are the replicas of one deployment, a song worker per GPU.

`yue2-vllm serve --replicas N` starts a local Ray cluster (one node) itself; `--ray-address ADDR` joins one
(`ray start --head` / `ray start --address HEAD:6379`). The ingress — this process — keeps the HTTP app and the
job store (admission, idempotency, listing, recovery) and hands each attempt of a job to Serve's deployment
handle as a streaming call; **Serve routes it** (power of two choices on the replicas' ongoing requests, at most
`max_ongoing_requests` = a replica's song concurrency each; the rest wait in the handle's queue, first in, first
out). The job's events stream back on that call; cancel requests and the replicas' load go through the job
board (`serve.replica`). A run whose replica dies (its stream fails with the actor gone) is put back by the
service and Serve restarts the replica.

Everything here imports Ray only when called: without the `ray` extra the single-process server is unchanged.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..artifacts import verify_result
from ..scheduler import FINAL_STATES, SongEvent
from .ray_cluster import (RAY_EXTRA, ReplicaShape, check_ray, cluster_nodes, connect,  # noqa: F401
                          local_resources, shape_replicas, write_cluster_file)  # (re-exported)
from .worker import ENGINE_DOWN, SongOrder, error_words

LOG = logging.getLogger("yue2_vllm.serve")
APP = "yue2"
DEPLOYMENT = "SongWorker"
REPORT_STALE_SECONDS = 10.0  # a replica whose last load report is older than this is not counted
REFUSED_RETRY_SECONDS = 1.0  # a run a replica refused goes again after this (doubling, at most 10 s)
# The engine state /health shows for several replicas: the best one among those alive.
ENGINE_ORDER = ("running", "unavailable", "start_failed", "none", "starting", "restarting", "failed")


# --------------------------------------------------------------------------- one attempt on a replica


class RemoteRun:
    """One attempt of a job on the replicas, as the service sees a run: `id`, `state`, `done`, `cancel()`,
    and the `replica` that took it."""

    def __init__(self, order: SongOrder, pool: "ReplicaPool"):
        self.order, self.id, self._pool = order, order.job_id, pool
        self.state = "queued"
        self.replica: str | None = None  # set when a replica takes it
        self.where: dict = {}
        self._ended = threading.Event()

    @property
    def accepted(self) -> bool:
        return self.replica is not None

    @property
    def done(self) -> bool:
        """The stream ended: nothing of this attempt runs anywhere any more."""
        return self._ended.is_set()

    def cancel(self) -> bool:
        """Ask the replica to stop it at its next boundary; True when no replica has taken it yet (it is
        cancelled now, and ends as soon as a replica takes it)."""
        self._pool.cancel(self)
        return not self.accepted


def visible_verdict(order: SongOrder, data: dict) -> tuple[str, dict]:
    """A replica's `complete`, checked from the ingress: the files it verified must be here too (the data dir is
    shared), else `failed` with the reason."""
    directory = Path(order.directory)
    try:
        if order.stage == "plan":
            if not (directory / "plan.stage.json").is_file():
                raise FileNotFoundError(f"{directory}/plan.stage.json is missing")
        else:
            verify_result(directory, (data.get("result") or {}).get("identity"))
    except Exception as exc:  # noqa: BLE001 (the record must not claim what this node cannot serve)
        return "failed", {"error": {"type": "VerificationError",
                                    "message": f"the replica finished the song, but its files do not verify in this "
                                               f"server's data dir (is it one file system shared by every node?): "
                                               f"{exc}"},
                          "result": None, "engine_failure": False}
    return "complete", data


def exception_line(text: str) -> str:
    """The exception a traceback ends with, as `Name: message` (Serve reports a failed constructor so)."""
    for line in reversed(text.strip().splitlines()):
        match = re.match(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*): (.+)$", line.strip())
        if match:
            return f"{match.group(1)}: {match.group(2)}"
    return text.strip().splitlines()[-1] if text.strip() else ""


def deployment_error() -> str:
    """Why Serve says the song-worker deployment is not healthy (a replica's constructor or health check), or ""."""
    from ray import serve

    try:
        status = serve.status().applications.get(APP)
        deployment = status.deployments.get(DEPLOYMENT) if status else None
    except Exception:  # noqa: BLE001 (no word from the controller: nothing to add)
        return ""
    return exception_line(deployment.message) if deployment is not None and deployment.message else ""


def replica_lost(exc: BaseException) -> bool:
    """Whether a failed stream means its replica is gone (its actor died or cannot be reached), rather than an
    error raised by the replica's own code."""
    from ray.exceptions import RayError, RayTaskError

    return isinstance(exc, RayError) and not isinstance(exc, RayTaskError)


# --------------------------------------------------------------------------- the pool


@dataclass
class _State:
    reports: dict = field(default_factory=dict)  # replica -> its last load report
    dead: set = field(default_factory=set)  # replicas whose streams failed with the actor gone
    restarts: dict = field(default_factory=dict)  # replica -> most engine restarts it reported
    serve_message: str = ""


class ReplicaPool:
    """The service's workers on Ray Serve (see the module docstring)."""

    def __init__(self, rules, spec, shape: ReplicaShape, *, backend: str, owns_cluster: bool):
        self.rules, self.spec, self.shape = rules, spec, shape
        self.backend, self.owns_cluster = backend, owns_cluster
        self.listener = None
        self.board = None
        self._handle = None
        self._failed: str | None = None  # the deployment failed for good
        self._runs: dict[str, RemoteRun] = {}
        self._lock = threading.Lock()
        self._state = _State()
        self._loop = asyncio.new_event_loop()
        self._ready: asyncio.Event | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop.run_forever, name="yue2-replica-streams", daemon=True),
                         threading.Thread(target=self._deploy, name="yue2-replica-deploy", daemon=True),
                         threading.Thread(target=self._watch, name="yue2-replica-watch", daemon=True)]

    @property
    def concurrency(self) -> int:
        return self.spec.concurrency * self.shape.replicas

    # -- lifecycle

    def start(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .replica import JobBoard

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.board = JobBoard.options(scheduling_strategy=here).remote()
        self._ready = asyncio.Event()
        for thread in self._threads:
            thread.start()

    def _deploy(self) -> None:
        from ray import serve

        from .replica import SongReplica

        try:
            serve.start(proxy_location="Disabled")
            if APP in serve.status().applications:  # an earlier ingress's replicas: replaced, never shared
                serve.delete(APP)
            deployment = serve.deployment(
                SongReplica, name=DEPLOYMENT, num_replicas=self.shape.replicas,
                max_ongoing_requests=self.spec.concurrency, ray_actor_options=self.shape.actor_options(),
                health_check_period_s=2, health_check_timeout_s=60, graceful_shutdown_wait_loop_s=1,
                graceful_shutdown_timeout_s=20, max_constructor_retry_count=3)
            handle = serve.run(deployment.bind(self.spec, self.board), name=APP, route_prefix=None)
        except Exception as exc:  # noqa: BLE001 (reported by /health and POST; the runs wait no more)
            self._failed = f"the replicas failed to start: {deployment_error() or error_words(exc)['message']}"
            LOG.error("%s", self._failed)
        else:
            self._handle = handle
            LOG.info("%d replica(s) ready", self.shape.replicas)
        self._loop.call_soon_threadsafe(self._ready.set)

    def close(self, timeout: float | None = None) -> bool:
        """Stop every run at its next boundary (waiting at most `timeout` s), then the replicas (and the local
        cluster, when this process started it)."""
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            self.cancel(run)
        deadline = time.monotonic() + (timeout if timeout is not None else 60.0)
        stopped = all(run._ended.wait(max(0.0, deadline - time.monotonic())) for run in runs)
        self._stop.set()
        self._shutdown()
        return stopped

    def _shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            if self.owns_cluster:  # the songs have stopped: the local cluster goes, replicas and all
                ray.shutdown()
            else:
                serve.delete(APP)
        except Exception:  # noqa: BLE001 (stopping anyway)
            LOG.warning("stopping the replicas failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)

    # -- runs

    def submit(self, order: SongOrder) -> RemoteRun:
        run = RemoteRun(order, self)
        with self._lock:
            self._runs[order.run_id] = run
        asyncio.run_coroutine_threadsafe(self._stream(run), self._loop)
        return run

    def cancel(self, run: RemoteRun) -> None:
        if self.board is not None and not run.done:
            self.board.cancel.remote(run.order.run_id)

    def _post(self, run: RemoteRun, kind: str, data: dict) -> None:
        if self.listener is not None:
            self.listener(SongEvent(run, kind, data))

    async def _stream(self, run: RemoteRun) -> None:
        """Follow one run to its end: its events go to the service, its final event only once the stream ended. A
        replica that refuses it before it starts (one Serve still routes to, but that cannot serve any more) is
        not the song's failure: the run is sent again (Serve drops the replica once its health check fails)."""
        final: tuple[str, dict] | None = None
        delay = REFUSED_RETRY_SECONDS
        try:
            await self._ready.wait()
            while True:
                final = await self._attempt(run)
                if not final[1].get("refused"):
                    break
                LOG.info("%s was refused by replica %s (%s); sending it again in %.0f s", run.order.run_id,
                         run.replica, final[1]["error"]["message"], delay)
                run.replica, run.where = None, {}
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)
        finally:
            with self._lock:
                self._runs.pop(run.order.run_id, None)
            if self.board is not None:
                self.board.forget.remote(run.order.run_id)
            run.state = final[0] if final else "failed"
            run._ended.set()
            if final is not None:
                self._post(run, *final)

    async def _attempt(self, run: RemoteRun) -> tuple[str, dict]:
        """One streaming call: the run's events to the service; its final event (or why the stream failed)."""
        final: tuple[str, dict] | None = None
        try:
            if self._handle is None:
                raise RuntimeError(self._failed or "the replicas are not running")
            response = self._handle.options(stream=True, method_name="run").remote(run.order.to_dict())
            async for event in response:
                kind, data = event["kind"], event["data"]
                if kind == "accepted":
                    run.replica, run.where = data["replica"], data
                    continue
                if kind in FINAL_STATES:
                    final = await asyncio.to_thread(visible_verdict, run.order, data) if kind == "complete" \
                        else (kind, data)
                    continue
                if kind == "state":
                    run.state = data["state"]
                self._post(run, kind, data)
            if final is None:
                raise RuntimeError(f"the stream from replica {run.replica} ended without the song's end")
        except Exception as exc:  # noqa: BLE001 (every way a stream ends is the run's end)
            if final is None:
                final = self._lost(run, exc)
        return final

    def _lost(self, run: RemoteRun, exc: BaseException) -> tuple[str, dict]:
        """The final event of a run whose stream failed."""
        if self._handle is None:  # the deployment never came up: no song can be served (the service holds it)
            return "failed", {"error": {"type": "ReplicasUnavailable", "message": str(exc)}, "result": None,
                              "engine_failure": True}
        lost = replica_lost(exc)
        if lost and run.replica is not None:
            self._state.dead.add(run.replica)
            self._state.reports.pop(run.replica, None)
            self.board.drop.remote(run.replica)
        where = f"replica {run.replica} on {run.where.get('host')}" if run.replica else "a replica"
        words = error_words(exc)["message"]
        message = f"{where} died while {run.state} ({words.strip().splitlines()[0][:300] if words.strip() else ''})" \
            if lost else words
        return "failed", {"error": {"type": "ReplicaDied" if lost else type(exc).__name__, "message": message,
                                    **({"replica": run.replica} if run.replica else {})},
                          "result": None, "engine_failure": False, "replica_lost": lost}

    # -- health

    def _watch(self) -> None:
        import ray

        last_status = 0.0
        while not self._stop.wait(1.0):
            try:
                reports = ray.get(self.board.reports.remote(), timeout=5)
                self._state.reports = {name: report for name, report in reports.items()
                                       if name not in self._state.dead}
                for name, report in reports.items():
                    restarts = (report.get("engine") or {}).get("restarts", 0)
                    self._state.restarts[name] = max(self._state.restarts.get(name, 0), restarts)
                if self._handle is not None and len(self._alive()) < self.shape.replicas \
                        and time.monotonic() - last_status > 5:
                    last_status = time.monotonic()
                    self._state.serve_message = deployment_error()
            except Exception:  # noqa: BLE001 (the next look may succeed)
                LOG.debug("replica watch failed", exc_info=True)

    def _alive(self) -> list[dict]:
        now = time.time()
        return [r for name, r in self._state.reports.items()
                if now - r.get("received", 0) < REPORT_STALE_SECONDS and not r.get("fatal")]

    def down_for_good(self) -> str | None:
        return self._failed

    def health(self) -> dict:
        alive = self._alive()
        target = self.shape.replicas
        states = [r["engine"]["state"] for r in alive]
        if states:
            state = min(states, key=lambda s: ENGINE_ORDER.index(s) if s in ENGINE_ORDER else len(ENGINE_ORDER))
        else:
            state = "failed" if self._failed else ("restarting" if self._handle is not None else "starting")
        engine = {"backend_requested": self.backend,
                  "backend": "torch" if self.backend == "torch" or state in ("unavailable", "start_failed", "none")
                  else "vllm",
                  "state": state, "restarts": sum(self._state.restarts.values())}
        problems = []
        if not alive:
            why = self._failed or self._state.serve_message or ("starting" if self._handle is None else
                                                                "no replica reports")
            problems.append(f"no replica can serve (0/{target}): {why}")
        elif state in ENGINE_DOWN:
            problems.append(f"the AR engine is {state} on every replica")
        replicas = [{key: r.get(key) for key in ("replica", "host", "node", "pid", "device", "in_flight", "queued",
                                                  "concurrency")} | {"engine": r["engine"]["state"]}
                    for r in sorted(alive, key=lambda r: r.get("rank", 0))]
        return {"engine": engine, "problems": problems, "replicas": f"{len(alive)}/{target}",
                "replica_states": replicas,
                "cluster": {"per_replica": {"gpus": self.shape.gpus, "cpus": self.shape.cpus,
                                            "concurrency": self.spec.concurrency},
                            **({"degraded": f"{target - len(alive)} of {target} replicas are not serving"
                                            + (f": {self._state.serve_message}" if self._state.serve_message else "")}
                               if 0 < len(alive) < target else {})}}

