"""What the workers' events do to a job (on the job owner): its live progress, its stage records, metrics and
SSE events; at a run's end its final record — or a retry when a dead engine or replica failed it, or a hold
while the engine is down for good."""
from __future__ import annotations

import logging
import re
import shutil
import time

from ..scheduler import FINAL_STATES, STAGE_STATES, SongEvent
from .owner import UNFINISHED, LiveJob
from .views import urls
from .worker import DISK_FULL

LOG = logging.getLogger("yue2_vllm.serve")
STAGE_OF_STATE = {state: stage for stage, state in STAGE_STATES.items()}


def fallback_label(reason: str) -> str:
    """A bounded Prometheus label for a fallback reason: its first clause, numbers as N."""
    text = re.split(r"[(:;]", reason, maxsplit=1)[0]
    return re.sub(r"\d+(?:\.\d+)?", "N", text).strip()[:80] or "other"


def stage_summary(stage: str, meta: dict, reused: bool) -> dict:
    """What a stage's record says, for the job document: timings, tokens, backend and fallback."""
    summary: dict = {"state": "reused" if reused else "done"}
    if stage in ("plan", "semantic"):
        timing = meta.get("timing") or {}
        summary.update(seconds=timing.get("seconds"), tokens=timing.get("output_tokens"),
                       tokens_per_second=timing.get("output_tps"),
                       backend_requested=timing.get("backend_requested"),
                       backend_actual=timing.get("backend_actual"), fallback_reason=timing.get("fallback_reason"),
                       truncated=meta.get("truncated"))
    elif stage == "synthesis":
        summary["seconds"] = meta.get("nar_seconds")
    else:
        summary.update(seconds=meta.get("vae_seconds"), samples=meta.get("samples"))
    return summary



class RunEvents:
    """The workers' events, turned into job transitions (part of `SongService`)."""

    def _on_event(self, event: SongEvent) -> None:
        job_id, kind, data = event.song.id, event.kind, event.data
        live = self._live.get(job_id)
        if live is None:
            return
        if live.handle is None:
            live.handle = event.song
        elif live.handle is not event.song:
            return  # an event of an earlier run of this job
        if kind in FINAL_STATES:
            try:
                if not live.finalized:
                    self._on_final(job_id, live, kind, data)
            finally:  # the run is done: what it said is in the store now (a retry has a new one)
                if self._live.get(job_id) is live:
                    del self._live[job_id]
                self.throttle.forget((job_id, "ar"))
                self.throttle.forget((job_id, "synthesis"))
                record = self.store.get(job_id)
                if job_id not in self._live and record is not None and record.deleted is not None:
                    self._remove(job_id)  # DELETEd while it ran: now it has stopped
            return
        if live.finalized:
            return
        if kind == "tokens":
            if job_id in self._awaiting_prefill:  # take 1's prompt is prefilled: the other takes go now
                self._launch_awaiting(job_id, ("_awaiting_prefill",))
            added = data["count"] - live.tokens[data["phase"]]  # a replica sends a count every few tokens
            if added > 0:
                self.tokens_total.inc(added, phase=data["phase"])
                self.token_rate.add(data["phase"], added)
            live.tokens[data["phase"]] = data["count"]
            if self.throttle.ready((job_id, "ar")):
                self.hub.publish(job_id, "tokens", {"phase": data["phase"], "count": data["count"],
                                                    "max_tokens": live.budgets[data["phase"]]})
        elif kind == "waiting":
            live.waiting = dict(data)
            self.hub.publish(job_id, "waiting", dict(data))
        elif kind in ("nar", "vae"):
            live.progress[kind] = (data["done"], data["total"])
            if self.throttle.ready((job_id, "synthesis"), force=data["done"] in (1, data["total"])):
                self.hub.publish(job_id, kind, {"done": data["done"], "total": data["total"]})
        elif kind == "state":
            self._on_state(job_id, live, data["state"])
        elif kind == "stage_done":
            self._on_stage_done(job_id, live, data["stage"], data["reused"], data["meta"] or {})
        elif kind == "score":
            self.hub.publish(job_id, "score", {"abc": data["abc"]})

    @staticmethod
    def _where(live: LiveJob) -> dict:
        """The replica running the job, for its stage records (nothing when the songs run in this process)."""
        replica = getattr(live.handle, "replica", None)
        return {"replica": replica} if replica else {}

    def _on_state(self, job_id: str, live: LiveJob, state: str) -> None:
        if state == "queued" or live.cancel_requested:
            return
        stage = STAGE_OF_STATE[state]
        now = time.time()
        live.record_stages[stage] = {"state": "running", "started": now, **self._where(live)}
        record = self.store.get(job_id)
        values = {"status": state, "stages": live.record_stages}
        if record is not None and record.started is None:
            values["started"] = now
        self.store.update(job_id, unless_final=True, **values)
        self.hub.publish(job_id, "state", {"status": state, "stage": stage, **self._where(live)})

    def _on_stage_done(self, job_id: str, live: LiveJob, stage: str, reused: bool, meta: dict) -> None:
        summary = stage_summary(stage, meta, reused)
        previous = live.record_stages.get(stage, {})
        where = {"replica": previous["replica"]} if reused and previous.get("replica") else self._where(live)
        live.record_stages[stage] = {**summary, "started": previous.get("started"),
                                     "finished": None if reused else time.time(), **where}
        self.store.update(job_id, stages=live.record_stages)
        if stage == "plan" and (job_id in self._awaiting_score or job_id in self._awaiting_prefill):
            self._launch_awaiting(job_id)
        if not reused:
            if stage in ("synthesis", "audio") and summary.get("seconds") is not None:
                (self.nar_seconds if stage == "synthesis" else self.vae_seconds).observe(summary["seconds"])
            reason = summary.get("fallback_reason")
            if reason:
                self.fallbacks.inc(phase="abc" if stage == "plan" else "semantic", reason=fallback_label(reason))
        self.hub.publish(job_id, "stage", {"stage": stage, **summary, **where})

    def _on_final(self, job_id: str, live: LiveJob, kind: str, data: dict) -> None:
        """A run's end. `data`: error, result, engine_failure (the engine died under it) and, from a replica pool,
        replica_lost (the replica died under it)."""
        error = data.get("error")
        if kind == "complete":
            self._record_final(job_id, live, "complete", result=data.get("result"))
            return
        if self.closing and not live.cancel_requested:
            return  # the server is stopping: the job stays unfinished and resumes at the next start
        if kind == "failed" and data.get("replica_lost") and not live.cancel_requested:
            if self._retry(job_id, live, error, kind="replica", limit=self.config.replica_retries):
                return
            error = {**error, "message": f"{error['message']} (the replica running this job died "
                                         f"{self.config.replica_retries + 1} times; not running it again)"}
        if kind == "failed" and data.get("engine_failure"):
            if self.workers.down_for_good() is not None and not live.cancel_requested:
                self._hold_for_engine(job_id, live, error)  # not the song's fault: it waits for the engine
                return
            if not live.cancel_requested and self._retry(job_id, live, error, kind="engine",
                                                         limit=self.config.engine_retries):
                return
        if kind == "cancelled" and error is None:
            error = {"type": "Cancelled", "message": "cancelled"}
        if error is not None and error.get("type") == DISK_FULL:
            free = shutil.disk_usage(self.config.data_dir).free
            error = {**error, "message": f"{error['message']}; the data dir {self.config.data_dir} has {free} bytes now "
                                         f"free: POST {urls(job_id)['self']}/resume once space returns"}
            LOG.error("job %s failed: its files could not be written (%s)", job_id, error["message"])
        self._record_final(job_id, live, kind, error=error)

    def _retry(self, job_id: str, live: LiveJob, error: dict, *, kind: str, limit: int) -> bool:
        """Put a song that a dead engine or replica failed back in the queue (resumed from its last verified
        stage), at most `limit` times per job."""
        record = self.store.get(job_id)
        if sum(1 for entry in record.retries if entry.get("kind") == kind) >= limit:
            return False
        what = "the AR engine failed" if kind == "engine" else "the replica running it died"
        reason = f"{what} ({error['message'][:300]}); retrying from the last verified stage"
        live.finalized = True
        record = self.store.requeue(job_id, None, reason=reason, kind=kind, from_statuses=UNFINISHED)
        (self.engine_retried if kind == "engine" else self.replica_retried).inc()
        self.hub.publish(job_id, "retry", {"reason": reason, "attempt": record.attempts + 1, "kind": kind})
        self._launch(record)
        return True

    def _hold_for_engine(self, job_id: str, live: LiveJob, error: dict) -> None:
        """No song can be served (the engine is down for good): the song goes back to the queue, held until the
        workers can serve again."""
        reason = f"the AR engine is down ({error['message'][:300]}); queued until it is back"
        live.finalized = True
        self.store.requeue(job_id, None, reason=reason, kind="engine-down", from_statuses=UNFINISHED)
        self.hub.publish(job_id, "state", {"status": "queued", "reason": reason})
        if job_id not in self._held:
            self._held.append(job_id)

    def _record_final(self, job_id: str, live: LiveJob | None, status: str, *, result: dict | None = None,
                      error: dict | None = None) -> None:
        if live is not None:
            if live.finalized:
                return
            live.finalized = True
        now = time.time()
        written = self.store.update(job_id, unless_final=True, status=status, finished=now, error=error,
                                    result=result, **({"stages": live.record_stages} if live else {}))
        if not written:
            return
        if job_id in self._awaiting_score or job_id in self._awaiting_prefill:  # take 1 ended: the others go on
            self._launch_awaiting(job_id)
        self.songs_finished.inc(status=status)
        record = self.store.get(job_id)
        if status == "complete":
            self.song_seconds.observe(now - record.created)
            if record.started is not None:
                self._durations.append(now - record.started)
        self.hub.publish(job_id, status, {"status": status, "error": error, "result": result, "urls": urls(job_id)})
