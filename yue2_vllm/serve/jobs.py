"""What the HTTP side asks of a job: submit, resume or render, cancel, delete — validated on the HTTP thread,
carried out on the job owner (`_call`), which alone launches a job to the workers and removes one."""
from __future__ import annotations

import logging
import shutil
import sqlite3
import time
from dataclasses import replace

from ..protocol import PHASES, SongRequest
from ..scheduler import STAGE_STATES
from ..song.continuation import CONTINUE_KEY, check_continuable, continued_id, read_parent
from .disk import request_bytes, written_bytes
from .errors import Conflict, NotFound, RequestInvalid, Unavailable
from .owner import LiveJob
from .store import IdempotencyConflict, JobRecord, NewJob, QueueFull
from .submission import canonical_sha256, check_idempotency_key, new_job_id, parse_continue, parse_submission
from .take_jobs import take_info, take_jobs
from .worker import SongOrder

LOG = logging.getLogger("yue2_vllm.serve")
STAGES = tuple(STAGE_STATES)  # plan, semantic, synthesis, audio


class JobActions:
    """Submit, launch, requeue, cancel and delete (part of `SongService`)."""

    def submit(self, body: bytes, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """Validate and queue a song; `(record, created)` (created False: an idempotent repeat)."""
        key = check_idempotency_key(idempotency_key)
        self._refuse_while_down()
        job_id = new_job_id()
        song = parse_submission(self.rules, body, job_id, self.config.max_takes)
        stages = {stage: {"state": "pending"} for stage in (STAGES if song.stage == "audio" else ("plan",))}
        count = song.takes.takes
        overrides, children = take_jobs(song, job_id, stages)  # take 1 is this job; takes 2..N jobs of their own
        job = NewJob(job_id, song.label, song.stage, song.request.to_dict(), overrides, song.body_sha256, key,
                     stages)
        need = request_bytes(self.rules, song.request, song.overrides, song.stage).total * count  # each take a song
        return self._admit_and_launch(job, need, children)

    def _refuse_while_down(self) -> None:
        """503 while no song can be served (the workers are down for good)."""
        down = self.workers.down_for_good()
        if down is not None:
            raise Unavailable(f"no song can be served now: {down}", headers={"Retry-After": "60"})

    def _admit_and_launch(self, job: NewJob, need: int, children=()) -> tuple[JobRecord, bool]:
        """Admit `job` (and its `children`, takes 2..N) if the disk holds `need` bytes more and the queue has room
        for all of them, then launch them; `(record, created)` of `job`."""
        with self.disk.lock:  # the check and the queueing together: two songs never take the same room
            self._check_disk(need)
            try:  # every take counts against the queue bound: room for all of them, or a 429
                record, created = self.store.admit(job, self.config.queue_size - len(children))
            except IdempotencyConflict as exc:
                raise Conflict(str(exc), field="Idempotency-Key") from None
            except QueueFull as exc:
                raise self._too_many(exc) from None
            except sqlite3.OperationalError as exc:  # the store refused the insert: nothing was queued
                raise self._store_refused(exc) from None
            takes = [record]
            if created:
                takes += [self.store.admit(child, None)[0] for child in children]
        if created:
            for take in takes:
                try:
                    self._call(self._launch, take)
                except Unavailable:  # the owner is waiting on the store: the job is durable, its launch queued
                    LOG.warning("job %s: accepted; it starts once the job owner's pending store write lands", take.id)
        return record, created

    def continue_song(self, job_id: str, body: bytes, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """POST /v1/songs/{id}/continue: a new job, the capped song of job `job_id` (or of its `take`) continued to
        `seconds` (song/continuation.py): the song its request with that length makes. What cannot continue is a
        422 in one line naming the field (`job_id` for the song's state or model, `seconds` for the length); the
        parent is only read. `(record, created)` as `submit`'s."""
        key = check_idempotency_key(idempotency_key)
        self._refuse_while_down()
        asked = parse_continue(body, self.config.max_takes)
        source = self.take_job(job_id, asked.take) if asked.take != 1 else job_id
        parent_record = self.get_record(source)
        what = f"song {job_id}" + (f" take {asked.take}" if asked.take != 1 else "")
        if parent_record.status != "complete" or parent_record.stage != "audio":
            raise RequestInvalid(f"job_id: {what} is {parent_record.status}"
                                 + (" (stage=plan: render it first)" if parent_record.stage == "plan" else "")
                                 + "; only a finished song whose cap cut it can continue", field="job_id")
        new_id = new_job_id()
        try:
            parent = read_parent(self.directory(source), what)
            request = parent.child_request(asked.seconds, new_id)
            weights = getattr(self.workers, "weights", None)  # a replica pool's run checks the model instead
            check_continuable(parent, weights if weights is not None else parent.weights, self.rules.generation,
                              self.directory(new_id))
            overrides = {**parent.overrides(), CONTINUE_KEY: {"parent": job_id, "take": asked.take,
                                                              "directory": str(self.directory(source))}}
            self.rules.check_request(request, overrides["abc"], overrides["semantic"])
        except ValueError as exc:  # continue: <what>: why, or seconds: why
            message = str(exc)
            field = "seconds" if message.startswith("seconds:") else "job_id"
            raise RequestInvalid(message.replace("continue: ", "job_id: ", 1), field=field) from None
        label = asked.label or continued_id(parent_record.label or job_id, asked.seconds)
        stages = {stage: {"state": "pending"} for stage in STAGES}
        job = NewJob(new_id, label, "audio", request.to_dict(), overrides,
                     canonical_sha256({"continue": source, "body": asked.body_sha256}), key, stages)
        return self._admit_and_launch(job, request_bytes(self.rules, request, overrides, "audio").total)

    def _launch(self, record: JobRecord) -> None:
        """Hand a queued job to the workers (owner only); held back while they cannot serve any song."""
        info = take_info(record)
        if info and info.get("share_score") and info.get("parent") and record.request.get("abc") is None:
            record = self._with_shared_score(record, info["parent"])
            if record is None:
                return  # it waits for take 1's score (launched from _on_stage_done), or failed with it
        elif info and info.get("parent") and not self._parent_prefilled(info["parent"]):
            waiting = self._awaiting_prefill.setdefault(info["parent"], [])
            if record.id not in waiting:
                waiting.append(record.id)
            return  # launched at take 1's first token (its prompt is then in the prefix cache) or end
        if self.workers.down_for_good() is not None:
            if record.id not in self._held:
                self._held.append(record.id)
            return
        request = SongRequest.from_dict(record.request)
        budgets = {phase: self.rules.phase_sampling(request, record.overrides.get(phase), phase).max_tokens
                   for phase in PHASES}
        # A stage an earlier attempt was running is pending again (a finished one may still be reused).
        stages = {name: entry if entry.get("state") != "running" else {"state": "pending"}
                  for name, entry in record.stages.items()}
        self.store.update(record.id, attempts=record.attempts + 1, stages=stages)
        live = self._live[record.id] = LiveJob(None, budgets, stages)
        self._last_progress = time.monotonic()
        order = SongOrder(record.id, record.attempts + 1, record.request, record.overrides, record.stage,
                          str(self.directory(record.id)))
        # The song may start (and post events) before submit returns: its first event names the run.
        live.handle = self.workers.submit(order)

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for job_id in held:
            record = self.store.get(job_id)
            if record is not None and record.status == "queued":
                self._launch(record)

    def requeue(self, job_id: str, *, render: bool) -> JobRecord:
        """Resume a failed or cancelled job from its last verified stage, or render a planned one to audio. On a
        job with takes: every take that can be (the others are left as they are)."""
        record = self.get_record(job_id)
        takes = self.take_records(record)
        if len(takes) > 1:
            ready = [take for take in takes if ((take.stage == "plan" and take.status == "complete") if render
                                                 else take.status in ("failed", "cancelled"))]
            if not ready:
                raise Conflict("no take of this job can be " + ("rendered (none is a complete stage=plan take)"
                                                                if render else "resumed (none failed or was cancelled)"))
            for take in ready:
                self._call(self._requeue, take.id, render)
            return self.get_record(job_id)
        if render and not (record.stage == "plan" and record.status == "complete"):
            raise Conflict(f"only a complete stage=plan job can be rendered; this one is {record.status} with "
                           f"stage={record.stage}")
        if not render and record.status not in ("failed", "cancelled"):
            raise Conflict(f"only a failed or cancelled job can be resumed; this one is {record.status}")
        return self._call(self._requeue, job_id, render)

    def _requeue(self, job_id: str, render: bool) -> JobRecord:
        live = self._live.get(job_id)
        if live is not None and not live.handle.done:
            raise Conflict("the job is still stopping; try again in a moment", headers={"Retry-After": "1"})
        record = self.get_record(job_id)
        bound = self._record_bytes(replace(record, stage="audio") if render else record)
        with self.disk.lock:
            self._check_disk(max(0, bound - written_bytes(self.directory(job_id))))
            try:
                record = self.store.requeue(job_id, self.config.queue_size, kind="render" if render else "resume",
                                            reason="render requested" if render else "resume requested",
                                            stage="audio" if render else None)
            except QueueFull as exc:
                raise self._too_many(exc) from None
            except LookupError:
                raise Conflict("the job changed meanwhile; read it again") from None
        if render:
            stages = {**record.stages, **{s: {"state": "pending"} for s in STAGES[1:]}}
            self.store.update(job_id, stages=stages)
            record.stages = stages
        self._launch(record)
        self.hub.publish(job_id, "state", {"status": "queued", "reason": record.retries[-1]["reason"]})
        return record

    def cancel(self, job_id: str) -> tuple[JobRecord, bool]:
        """Ask a job (every take of it) to stop at its next token, ODE step or VAE tile; `(record, asked)` —
        asked False when it had finished already (its files stay)."""
        record = self.get_record(job_id)
        running = [take for take in self.take_records(record) if not take.final]
        if not running:
            return record, False
        for take in reversed(running):  # take 1 last: its end would launch takes still waiting for it
            self._call(self._cancel, take.id)
        return self.store.get(job_id), True

    def _cancel(self, job_id: str) -> tuple[JobRecord, bool]:
        record = self.store.get(job_id)
        if record is None or record.final:
            return record, False
        live = self._live.get(job_id)
        self.store.update(job_id, cancel_requested=1)
        started = False
        if live is not None:
            live.cancel_requested = True
            started = not live.handle.cancel()  # a song thread had taken it: it stops at its next boundary
        if not started:  # a queued (or held) song never starts: it is cancelled now, not when a thread frees up
            if job_id in self._held:
                self._held.remove(job_id)
            self._record_final(job_id, live, "cancelled", error={"type": "Cancelled",
                                                                  "message": "cancelled before it started"})
        return self.store.get(job_id), True

    def delete(self, job_id: str) -> dict | None:
        """DELETE: the job is gone for every client at once (each read answers 404); a run of it is cancelled, and
        its files and row are removed once nothing of it runs. The job as it is now while that removal is pending
        (a run was stopping), None once it is done. Its other takes go with it."""
        record = self.get_record(job_id)
        for take in self.take_records(record)[1:]:
            self._call(self._delete_quietly, take.id)
        return self._call(self._delete, job_id)

    def _delete_quietly(self, job_id: str) -> None:
        try:
            self._delete(job_id)
        except NotFound:  # deleted already (e.g. that take alone)
            pass

    def _delete(self, job_id: str) -> dict | None:
        record = self.store.mark_deleted(job_id)
        if record is None:
            raise NotFound(f"no song {job_id!r}")
        if not record.final:
            self._cancel(job_id)
        live = self._live.get(job_id)
        if live is not None and (live.handle is None or not live.handle.done):
            return self.describe(self.store.get(job_id))  # removed when its final event comes (see _on_event)
        self._remove(job_id)
        return None

    def _remove(self, job_id: str) -> bool:
        """Remove a finished or deleted job's files and row (owner; nothing of it may run). Whether it was here."""
        self._live.pop(job_id, None)
        if job_id in self._held:
            self._held.remove(job_id)
        if not self.store.delete(job_id):
            return False
        directory = self.directory(job_id)
        doomed = directory.with_name(directory.name + ".purging")
        try:
            directory.rename(doomed)  # gone from the data dir at once; removed below
        except FileNotFoundError:
            pass
        shutil.rmtree(doomed, ignore_errors=True)
        self.purged.inc()
        return True
