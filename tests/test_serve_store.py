"""The durable job store on real SQLite files: admission, idempotency, the queue bound, order, schema, crashes."""
import os
import signal
import sqlite3
import subprocess
import sys
import threading

import pytest

from yue2_vllm.serve.store import (SCHEMA, SCHEMA_VERSION, IdempotencyConflict, JobStore, NewJob, QueueFull, StoreError)


def job(number: int, key: str | None = None, body: str = "b") -> NewJob:
    return NewJob(f"j{number:020x}", None, "audio", {"style": "s", "lyrics": "l"}, {}, body, key,
                  {"plan": {"state": "pending"}})


@pytest.fixture
def store(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    yield store
    store.close()


def test_admitted_jobs_are_listed_newest_first_in_pages(store):
    for number in range(5):
        record, created = store.admit(job(number), queue_limit=None)
        assert created and record.status == "queued" and record.seq == number + 1
    first = store.list(limit=2)
    assert [r.id for r in first] == [job(4).id, job(3).id]
    second = store.list(limit=2, before=first[-1].seq)
    assert [r.id for r in second] == [job(2).id, job(1).id]
    assert [r.id for r in store.list(limit=10, before=second[-1].seq)] == [job(0).id]
    store.update(job(1).id, status="complete")
    assert [r.id for r in store.list(("complete",))] == [job(1).id]
    assert [r.id for r in store.unfinished()] == [job(n).id for n in (0, 2, 3, 4)]  # creation order
    assert store.queue_position(store.get(job(3).id)) == 2


def test_the_queue_bound_counts_only_jobs_that_have_not_started(store):
    for number in range(3):
        store.admit(job(number), queue_limit=3)
    with pytest.raises(QueueFull) as full:
        store.admit(job(9), queue_limit=3)
    assert (full.value.depth, full.value.limit) == (3, 3)
    assert store.get(job(9).id) is None
    store.update(job(0).id, status="planning")
    store.admit(job(9), queue_limit=3)
    assert store.queued() == 3 and store.counts() == {"queued": 3, "planning": 1}


def test_an_idempotency_key_names_one_job_and_one_body(store):
    first, created = store.admit(job(1, key="k"), queue_limit=None)
    again, created_again = store.admit(job(2, key="k"), queue_limit=None)
    assert created and not created_again and again.id == first.id
    with pytest.raises(IdempotencyConflict) as conflict:
        store.admit(job(3, key="k", body="other"), queue_limit=None)
    assert conflict.value.job_id == first.id
    assert [r.id for r in store.list()] == [first.id]


def race(clients: int, admit) -> list:
    outcomes, lock, barrier = [], threading.Lock(), threading.Barrier(clients)

    def client(number):
        barrier.wait()
        try:
            record, created = admit(number)
            outcome = ("created" if created else "repeat", record.id)
        except QueueFull:
            outcome = ("full", None)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_admission_is_atomic_under_concurrent_clients(store):
    stores = [store, JobStore(store.path)]  # two connections: SQLite's BEGIN IMMEDIATE, not a Python lock, decides
    outcomes = race(16, lambda n: stores[n % 2].admit(job(n), queue_limit=5))
    assert sorted(kind for kind, _ in outcomes) == ["created"] * 5 + ["full"] * 11
    assert store.queued() == 5
    keyed = race(8, lambda n: stores[n % 2].admit(job(100 + n, key="same"), queue_limit=None))
    assert sorted(kind for kind, _ in keyed) == ["created"] + ["repeat"] * 7
    assert len({record_id for _, record_id in keyed}) == 1  # one job for the key, however many clients raced
    stores[1].close()


def test_updates_never_leave_a_final_state_except_through_requeue(store):
    store.admit(job(1), queue_limit=None)
    assert store.update(job(1).id, unless_final=True, status="planning")
    assert store.update(job(1).id, status="cancelled", error={"type": "Cancelled", "message": "x"})
    assert not store.update(job(1).id, unless_final=True, status="generating")
    assert store.get(job(1).id).status == "cancelled"
    store.admit(job(2), queue_limit=None)
    with pytest.raises(QueueFull):
        store.requeue(job(1).id, 1, reason="resume requested", kind="resume")
    record = store.requeue(job(1).id, None, reason="resume requested", kind="resume")
    assert record.status == "queued" and record.error is None
    assert [(r["kind"], r["reason"]) for r in record.retries] == [("resume", "resume requested")]
    with pytest.raises(LookupError):  # queued is not final
        store.requeue(job(1).id, None, reason="again", kind="resume")
    with pytest.raises(ValueError, match="not updatable"):
        store.update(job(1).id, id="elsewhere")


def test_jobs_survive_reopening_in_wal_mode(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    store.admit(job(1, key="k"), queue_limit=None)
    store.update(job(1).id, status="generating", stages={"plan": {"state": "done", "seconds": 1.5}})
    store.close()
    again = JobStore(path)
    record = again.get(job(1).id)
    assert record.status == "generating" and record.stages["plan"]["seconds"] == 1.5
    assert record.idempotency_key == "k" and record.request == {"style": "s", "lyrics": "l"}
    again.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_deleted_job_is_hidden_its_key_freed_and_its_row_removable_while_unfinished(store):
    store.admit(job(1, key="k"), queue_limit=None)
    store.admit(job(2), queue_limit=None)
    store.update(job(1).id, status="generating")
    before = store.mark_deleted(job(1).id)
    assert before.status == "generating" and before.deleted is None and not before.cancel_requested
    assert store.mark_deleted(job(1).id) is None  # once
    record = store.get(job(1).id)
    assert record.deleted is not None and record.cancel_requested and record.idempotency_key is None
    assert [r.id for r in store.list()] == [job(2).id] and store.counts() == {"queued": 1}
    assert store.deleted_ids() == [job(1).id]
    with pytest.raises(LookupError):  # never resumed
        store.requeue(job(1).id, None, reason="resume requested", kind="resume", from_statuses=("generating",))
    again, created = store.admit(job(3, key="k", body="other"), queue_limit=None)  # the key names no job now
    assert created and again.id == job(3).id
    assert not store.delete(job(2).id)  # neither finished nor deleted: never removed
    assert store.delete(job(1).id) and store.get(job(1).id) is None and store.deleted_ids() == []


def test_a_schema_1_store_is_migrated_in_place(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    with sqlite3.connect(path) as db:  # what yue2-vllm wrote before the deleted column
        lines = [line for line in SCHEMA.splitlines() if not line.lstrip().startswith("deleted REAL")]
        db.executescript("\n".join(lines).replace("    result TEXT,", "    result TEXT"))
        db.execute("PRAGMA user_version=1")
        db.execute("INSERT INTO jobs (id, status, stage, request, overrides, body_sha256, created, updated) "
                   "VALUES ('j00000000000000000001', 'complete', 'audio', '{}', '{}', 'b', 1, 1)")
    store = JobStore(path)
    record = store.get("j00000000000000000001")
    assert record.status == "complete" and record.deleted is None
    assert store.mark_deleted(record.id) is not None and store.delete(record.id)
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2


def test_a_newer_schema_or_a_foreign_database_is_refused(tmp_path):
    newer = tmp_path / "newer.sqlite3"
    with sqlite3.connect(newer) as db:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer yue2-vllm"):
        JobStore(newer)
    foreign = tmp_path / "foreign.sqlite3"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE songs (x)")
    with pytest.raises(StoreError, match="not a yue2-vllm job store"):
        JobStore(foreign)


def test_an_admitted_job_survives_kill_9_right_after_admission(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    code = ("import os, sys\nfrom yue2_vllm.serve.store import JobStore, NewJob\n"
            f"store = JobStore({str(path)!r})\n"
            "store.admit(NewJob('j' + '0' * 20, None, 'audio', {}, {}, 'b'), None)\n"
            "print('admitted', flush=True)\nsys.stdin.read()\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               env={**os.environ})
    assert process.stdout.readline() == b"admitted\n"
    process.send_signal(signal.SIGKILL)
    process.wait()
    store = JobStore(path)
    assert store.get("j" + "0" * 20).status == "queued"
    store.close()
