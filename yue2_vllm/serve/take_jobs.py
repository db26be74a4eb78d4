"""Takes: a job of N takes is take 1 plus N-1 jobs of their own, listed (and acted on) through take 1. Their
records, the score they may share and the prefill they wait for, keeping or deleting one, and what GET shows."""
from __future__ import annotations

from ..protocol import SongRequest
from ..takes import pick_take, read_score, shares_plan, take_seed
from .errors import Conflict, NotFound
from .store import JobRecord, NewJob
from .submission import new_job_id


def take_urls(job_id: str, take: int, take_job: str) -> dict:
    """Take k's files under its job (`events`: the take's own job, whose id the listing names)."""
    base = f"/v1/songs/{job_id}/takes/{take}"
    return {"self": base, "events": f"/v1/songs/{take_job}/events", "audio": f"{base}/audio",
            "score": f"{base}/score", "result": f"{base}/result", "keep": f"{base}/keep"}


def take_info(record: JobRecord) -> dict | None:
    """A job's takes record (in its overrides): take 1's lists the others (`children`); take k's names its
    `parent`. None for a one-take job."""
    info = record.overrides.get("takes")
    return info if isinstance(info, dict) else None



def take_jobs(song, job_id: str, stages: dict) -> tuple[dict, list[NewJob]]:
    """A parsed submission of N takes: take 1's overrides (listing the others) and takes 2..N as new jobs."""
    count = song.takes.takes
    if count == 1:
        return song.overrides, []
    children = [new_job_id() for _ in range(count - 1)]
    share = shares_plan(song.request, song.takes)
    overrides = {**song.overrides, "takes": {"take": 1, "of": count, "best_of": song.takes.best_of,
                                             "share_score": share, "children": children, "kept": None}}
    jobs = []
    for k, child in enumerate(children, 2):
        request = SongRequest.from_dict({**song.request.to_dict(), "id": child,
                                         "seed": take_seed(song.request.seed, k)})
        jobs.append(NewJob(child, song.label, song.stage, request.to_dict(),
                           {**song.overrides, "takes": {"take": k, "of": count, "parent": job_id,
                                                        "share_score": share}},
                           song.body_sha256, None, dict(stages)))
    return overrides, jobs


class Takes:
    """A job's takes (part of `SongService`): the owner launches takes 2..N once take 1 has what they share."""

    def _init_takes(self) -> None:
        self._awaiting_score: dict[str, list[str]] = {}  # take 1's job -> takes waiting for its planned score
        self._awaiting_prefill: dict[str, list[str]] = {}  # take 1's job -> takes waiting for its first token

    def take_records(self, record: JobRecord) -> list[JobRecord]:
        """A job's takes in order, take 1 (the job) first; takes deleted on their own are left out."""
        info = take_info(record)
        if not info or info.get("parent"):
            return [record]
        takes = [record]
        for child in info.get("children", []):
            take = self.store.get(child)
            if take is not None and take.deleted is None:
                takes.append(take)
        return takes

    def take_job(self, job_id: str, take: int) -> str:
        """The job id that holds take `take` of job `job_id` (404 when there is no such take)."""
        record = self.get_record(job_id)
        info = take_info(record)
        if take == 1 and (info is None or not info.get("parent")):
            return job_id
        children = (info or {}).get("children") if info and not info.get("parent") else None
        if not children or not 2 <= take <= len(children) + 1:
            raise NotFound(f"song {job_id!r} has no take {take}")
        child = children[take - 2]
        self.get_record(child)  # 404 once that take was deleted
        return child

    def delete_take(self, job_id: str, take: int) -> dict | None:
        """Delete one take (k >= 2; take 1 is the job itself: DELETE the job)."""
        if take == 1:
            raise Conflict("take 1 is the job itself: DELETE the job to remove it with every take")
        child = self.take_job(job_id, take)
        return self._call(self._delete, child)

    def keep_take(self, job_id: str, take: int) -> JobRecord:
        """Mark take `take` as the one kept (recorded on the job)."""
        self.take_job(job_id, take)
        record = self.get_record(job_id)
        info = take_info(record)
        if info is None or info.get("parent"):
            raise Conflict("this job has no takes to choose from")
        self.store.update(job_id, overrides={**record.overrides, "takes": {**info, "kept": take}})
        return self.get_record(job_id)

    def takes_view(self, record: JobRecord) -> dict | None:
        """What GET shows of a job's takes: each with status, seed, signals and links; the pick and the kept."""
        info = take_info(record)
        if info is None:
            return None
        if info.get("parent"):
            return {"take": info["take"], "of": info["of"], "job": info["parent"]}
        entries = []
        ids = [record.id] + list(info.get("children", []))
        for k, take_id in enumerate(ids, 1):
            take = record if k == 1 else self.store.get(take_id)
            if take is None or take.deleted is not None:
                entries.append({"take": k, "id": take_id, "status": "deleted", "seed": None, "signals": {},
                                "error": None, "urls": None})
                continue
            entries.append({"take": k, "id": take_id, "status": take.status, "seed": take.request.get("seed"),
                            "signals": (take.result or {}).get("signals") or {},
                            "audio_seconds": (take.result or {}).get("audio_seconds"),
                            "error": (take.error or {}).get("message"), "urls": take_urls(record.id, k, take_id)})
        pick = pick_take(entries) if info.get("best_of") else None
        return {"take": 1, "of": info["of"], "best_of": bool(info.get("best_of")),
                "share_score": bool(info.get("share_score")), "signal": "semantic_mean_logprob", "pick": pick,
                "kept": info.get("kept"), "entries": entries,
                "complete": [e["take"] for e in entries if e["status"] == "complete"],
                "not_complete": [e["take"] for e in entries if e["status"] in ("failed", "cancelled", "deleted")]}

    def _with_shared_score(self, record: JobRecord, parent_id: str) -> JobRecord | None:
        """Take k of a shared score renders take 1's: its request gets that score once take 1 planned it."""
        parent = self.store.get(parent_id)
        plan = (parent.stages.get("plan") or {}).get("state") if parent is not None else None
        if plan in ("done", "reused"):
            try:
                score = read_score(self.directory(parent_id))
            except OSError as exc:
                self._record_final(record.id, None, "failed", error={"type": "SharedScoreMissing",
                                   "message": f"take 1's score could not be read: {exc}"})
                return None
            request = {**record.request, "abc": score}
            self.store.update(record.id, request=request)
            return self.store.get(record.id)
        if parent is None or parent.deleted is not None or (parent.final and parent.status != "complete"):
            self._record_final(record.id, None, "failed", error={"type": "SharedScoreMissing",
                               "message": "take 1's score was not planned (take 1 "
                                          f"{'is gone' if parent is None or parent.deleted else parent.status})"})
            return None
        waiting = self._awaiting_score.setdefault(parent_id, [])
        if record.id not in waiting:
            waiting.append(record.id)
        return None

    def _parent_prefilled(self, parent_id: str) -> bool:
        """Whether take 1 has had its first AR token (or a planned score, or has ended): the other takes then find
        the prompt they share in the engine's prefix cache instead of prefilling it again in the same step."""
        live = self._live.get(parent_id)
        if live is not None and any(live.tokens.values()):
            return True
        parent = self.store.get(parent_id)
        return parent is None or parent.final or (parent.stages.get("plan") or {}).get("state") in ("done", "reused")

    def _launch_awaiting(self, parent_id: str, lists: tuple[str, ...] = ("_awaiting_score", "_awaiting_prefill")) \
            -> None:
        """Take 1's score is planned, its prompt prefilled, or it ended: the takes waiting for that go on."""
        children = [child for name in lists for child in getattr(self, name).pop(parent_id, [])]
        for child in children:
            record = self.store.get(child)
            if record is not None and record.status == "queued" and record.deleted is None:
                self._launch(record)
