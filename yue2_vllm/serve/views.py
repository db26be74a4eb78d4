"""The JSON documents the service answers with: a job (GET /v1/songs/{id}), the list, a job's ready files,
its picture and its SSE subscription."""
from __future__ import annotations

import json
import threading
import weakref
from datetime import datetime, timezone
from pathlib import Path

from ..checkpoint import write_json_atomic
from ..protocol import SongRequest
from ..song.continuation import CONTINUE_KEY
from ..scheduler import STATES
from .errors import Conflict, NotFound, RequestInvalid
from .picture import PICTURE_VERSION, song_picture
from .store import FINAL, JobRecord
from .submission import song_length
from .take_jobs import take_info

PICTURE_CACHE = "page-cache/picture.json"  # a directory: never among a run's artifacts


def iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def urls(job_id: str) -> dict:
    base = f"/v1/songs/{job_id}"
    return {"self": base, "events": f"{base}/events", "audio": f"{base}/audio", "score": f"{base}/score",
            "result": f"{base}/result"}


def sampling_of(record: JobRecord) -> dict:
    return {k: v for k, v in record.overrides.items() if k not in ("takes", CONTINUE_KEY)}


class KeyedLocks:
    """A lock per key, kept only while someone holds it: work on one key waits for work on that key alone."""

    def __init__(self):
        self._locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._guard = threading.Lock()

    def __call__(self, key) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())



class Views:
    """Reads (part of `SongService`): they take no lock and change nothing."""

    def _init_views(self) -> None:
        self._picture_locks = KeyedLocks()

    def document(self, job_id: str) -> dict:
        return self.describe(self.get_record(job_id))

    def song_length(self, body: bytes) -> dict:
        """POST /v1/songs/length: the longest song a body can reach and whether its own length fits."""
        return song_length(self.rules, body, self.config.max_takes)

    def describe(self, record: JobRecord) -> dict:
        """A job as GET /v1/songs/{id} shows it."""
        live = self._live.get(record.id)
        stages = dict(record.stages)
        running = live is not None and not live.finalized
        progress = {}
        for phase, stage in (("abc", "plan"), ("semantic", "semantic")):
            if stage not in stages:
                continue
            if stages[stage].get("state") in ("done", "reused"):
                tokens = stages[stage].get("tokens") or 0
            else:
                tokens = live.tokens[phase] if running else 0
            budget = self.rules.phase_sampling(SongRequest.from_dict(record.request), record.overrides.get(phase),
                                               phase).max_tokens
            progress[phase] = {"tokens": tokens, "max_tokens": budget}
        if running:
            for stage, (done, total) in list(live.progress.items()):
                progress[stage] = {"done": done, "total": total}
            waiting = live.waiting
            if waiting is not None and waiting["stage"] not in live.progress:
                progress[waiting["stage"]] = {"waiting_for_room": {"need_bytes": waiting["need_bytes"],
                                                                   "free_bytes": waiting["free_bytes"]}}
        for stage, entry in stages.items():
            stages[stage] = {k: (iso(v) if k in ("started", "finished") else v) for k, v in entry.items()}
        document = {
            "id": record.id, "label": record.label, "status": record.status, "stage": record.stage,
            "created": iso(record.created), "started": iso(record.started), "finished": iso(record.finished),
            "updated": iso(record.updated),
            "request": {k: v for k, v in record.request.items() if k != "id"},
            "sampling": sampling_of(record), "progress": progress, "stages": stages,
            "attempts": record.attempts,
            "retries": [{**entry, "at": iso(entry["at"])} for entry in record.retries],
            "cancel_requested": record.cancel_requested, "error": record.error, "result": record.result,
            "urls": urls(record.id),
        }
        if record.status == "queued":
            document["queue_position"] = self.store.queue_position(record)
        takes = self.takes_view(record)
        if takes is not None:
            document["takes"] = takes
        continued = record.overrides.get(CONTINUE_KEY)
        if continued:  # the song it continues (its job, and take)
            document["continued_from"] = {"id": continued["parent"], "take": continued["take"]}
        return document

    def summary(self, record: JobRecord) -> dict:
        """A job as the list shows it."""
        return {"id": record.id, "label": record.label, "status": record.status, "stage": record.stage,
                "created": iso(record.created), "finished": iso(record.finished),
                "style": record.request.get("style", "")[:120], "cot": record.request.get("cot"),
                "seed": record.request.get("seed"),
                "audio_seconds": (record.result or {}).get("audio_seconds"),
                "error": (record.error or {}).get("message"), "urls": urls(record.id),
                "takes": (take_info(record) or {}).get("of", 1)}

    def list(self, statuses: tuple[str, ...], limit: int, cursor: str | None) -> dict:
        unknown = sorted(set(statuses) - set(STATES))
        if unknown:
            raise RequestInvalid(f"status: {unknown} not among {list(STATES)}", field="status")
        before = None
        if cursor:
            if not cursor.isdigit() or len(cursor) > 18:
                raise RequestInvalid(f"cursor: not a cursor this server gave out: {cursor[:40]!r}", field="cursor")
            before = int(cursor)
        records = self.store.list(statuses, limit + 1, before)
        page = records[:limit]
        return {"songs": [self.summary(r) for r in page if not (take_info(r) or {}).get("parent")],  # takes 2..N: in
                # their job's listing
                "next_cursor": str(page[-1].seq) if len(records) > limit else None}

    def file(self, job_id: str, name: str) -> Path:
        """An artifact of a job that is ready to be read (Conflict while it is not)."""
        record = self.get_record(job_id)
        directory = self.directory(job_id)
        if name == "score.abc":
            plan = record.stages.get("plan", {})
            if plan.get("state") not in ("done", "reused"):
                raise Conflict(f"the score is not ready (status {record.status})")
            if record.request.get("cot") == "off":
                raise NotFound("this song has no score (cot 'off' writes none)")
        elif record.stage == "plan":
            raise Conflict(f"this job was made with stage=plan: it has a score, not {name}; "
                           f"POST {urls(job_id)['self']}/render to make its audio")
        elif record.status != "complete":
            raise Conflict(f"{name} is not ready (status {record.status})")
        path = directory / name
        if path.is_symlink() or not path.is_file():
            raise Conflict(f"{name} is missing from the job's directory")
        return path

    def picture(self, job_id: str) -> dict:
        """The song's peaks and spectrogram (`serve.picture`), computed from its FLAC once and cached beside it
        (`page-cache/picture.json`, written atomically; redone if the FLAC changed or the format did)."""
        path = self.file(job_id, "audio.flac")
        stat = path.stat()
        source = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        cache = path.parent / PICTURE_CACHE
        with self._picture_locks(job_id):  # one computation per song, whoever asks meanwhile (no other song waits)
            try:
                cached = json.loads(cache.read_text(encoding="utf-8"))
                if cached.get("source") == source and cached.get("version") == PICTURE_VERSION:
                    return cached
            except (OSError, ValueError):
                pass
            document = {**song_picture(path), "source": source}
            cache.parent.mkdir(exist_ok=True)
            write_json_atomic(cache, document)
            return document

    def subscribe(self, job_id: str, loop):
        record = self.get_record(job_id)
        return self.hub.subscribe(record.id, loop, lambda: self.document(record.id))

    def subscribe_final(self, job_id: str, loop):
        """`(subscriber, record)`: the job's final events (and the hub's STOPPING) from now on, and its record as it
        is now. The owner writes a final status before it publishes it, so it is in the record or comes."""
        return self.hub.subscribe(job_id, loop, lambda: self.get_record(job_id), frozenset(FINAL))
