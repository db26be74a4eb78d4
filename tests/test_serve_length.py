"""A song's length over HTTP on real uvicorn servers (serve/routes/length.py): `seconds` on POST /v1/songs caps a
song on the record, POST /v1/songs/length says the longest song a body can reach, and POST /v1/songs/{id}/continue
makes a new, durable job: the song the capped one's request with the longer length makes (its takes too); what
cannot continue is a 422 in one line naming the field, and the parent is left as it was; a continue job is
durable (it survives a restart)."""
import pytest

from yue2_vllm.protocol import SongRequest
from yue2_vllm.serve.service import ServeConfig, SongService

from serving import ThreadServer, pipe, wait_for  # noqa: F401 (pipe: a fixture)

# serving.GENERATION: 12 semantic tokens at least and at most, so 0.48 s (12 tokens) is the shortest song here.
SONG = {"style": "pop, piano", "lyrics": "[verse]\nla la la\n", "seed": 7}
FINAL = ("complete", "failed", "cancelled")


@pytest.fixture
def server(pipe, tmp_path):
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path / "data", concurrency=1)))
    yield server
    server.stop()


def final(client, job_id, timeout=180) -> dict:
    return wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(), lambda d: d["status"] in FINAL, timeout)


def queue(client, path="/v1/songs", expect=202, headers=None, **body) -> dict:
    response = client.post(path, json=body, headers=headers)
    assert response.status_code == expect, response.text
    return response.json()


def refused(client, path, body, field, words, status=422):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["field"], "\n" in error["message"]) == (field, False) and words in error["message"], error
    return error


def test_seconds_caps_a_song_and_continue_makes_the_longer_song_as_a_new_job(server):
    client = server.client
    capped = queue(client, **SONG, seconds=0.48, id="ballad")
    doc = final(client, capped["id"])
    assert doc["status"] == "complete" and doc["request"]["seconds"] == 0.48
    assert doc["result"]["truncated"]["semantic"] is True
    assert doc["result"]["truncation"]["semantic"] == {"by": "seconds", "tokens": 12, "seconds": 0.48}
    parent_result = client.get(f"/v1/songs/{capped['id']}/result").content

    key = {"Idempotency-Key": "continue-ballad-1"}
    job = queue(client, f"/v1/songs/{capped['id']}/continue", headers=key, seconds=0.8)
    assert job["label"] == "ballad.0.8s" and job["stage"] == "audio"
    again = queue(client, f"/v1/songs/{capped['id']}/continue", expect=200, headers=key, seconds=0.8)
    assert again["id"] == job["id"] and again["created"] is False  # the key's job, not a second one
    doc = final(client, job["id"])
    assert doc["status"] == "complete", doc["error"]
    assert doc["continued_from"] == {"id": capped["id"], "take": 1}
    assert doc["result"]["continuation"]["exact"] is True and doc["result"]["audio_seconds"] == (20 * 1920 - 64) / 48000
    assert doc["sampling"]["semantic"]["temperature"] == 1.0 and "continue" not in doc["sampling"]
    longer = final(client, queue(client, **SONG, seconds=0.8)["id"])  # the same request with 0.8 s from the start
    assert client.get(f"/v1/songs/{job['id']}/audio").content == client.get(f"/v1/songs/{longer['id']}/audio").content
    assert client.get(f"/v1/songs/{capped['id']}/result").content == parent_result  # the parent only read

    # cancelled and resumed like any job (its overrides, in the durable store, still name the song it continues)
    stopped = queue(client, f"/v1/songs/{capped['id']}/continue", seconds=0.8, id="again")
    client.post(f"/v1/songs/{stopped['id']}/cancel")
    if final(client, stopped["id"])["status"] == "cancelled":
        assert client.post(f"/v1/songs/{stopped['id']}/resume").status_code == 202
    assert final(client, stopped["id"])["status"] == "complete"
    assert client.get(f"/v1/songs/{stopped['id']}/audio").content == client.get(f"/v1/songs/{job['id']}/audio").content


def test_a_take_of_a_job_continues_like_any_song(server):
    client = server.client
    job = queue(client, **SONG, seconds=0.48, takes=2)
    wait_for(lambda: client.get(f"/v1/songs/{job['id']}").json(),
             lambda d: all(e["status"] in FINAL for e in d["takes"]["entries"]), 300)
    second = queue(client, f"/v1/songs/{job['id']}/continue", seconds=0.8, take=2)
    doc = final(client, second["id"])
    assert doc["status"] == "complete" and doc["continued_from"] == {"id": job["id"], "take": 2}
    assert doc["request"]["seed"] == 8  # take 2's
    refused(client, f"/v1/songs/{job['id']}/continue", {"seconds": 0.8, "take": 3}, None,
            f"song {job['id']!r} has no take 3", status=404)


def test_what_cannot_continue_is_a_422_naming_the_field(server):
    client = server.client
    capped = queue(client, **SONG, seconds=0.48)
    planned = queue(client, **SONG, stage="plan")
    final(client, capped["id"]), final(client, planned["id"])
    path = f"/v1/songs/{capped['id']}/continue"
    refused(client, path, {"seconds": 0.48}, "seconds", "0.48 caps the song at 12 tokens, and it has 12 (0.48 s) "
                                                        "already; ask for more than 0.48 seconds")
    refused(client, path, {}, "seconds", "seconds: missing")
    refused(client, path, {"seconds": "long"}, "seconds", "seconds must be a positive number of seconds")
    refused(client, path, {"seconds": 2000}, "seconds", "must be at most 983.04")
    refused(client, path, {"seconds": 983}, "seconds", "seconds: the request is too long")
    refused(client, path, {"seconds": 2, "tempo": 1}, "tempo", "unknown field(s) ['tempo']")
    refused(client, path, {"seconds": 2, "id": "../x"}, "id", "id: must match")
    refused(client, f"/v1/songs/{planned['id']}/continue", {"seconds": 2}, "job_id", "stage=plan: render it first")
    refused(client, "/v1/songs/j0123456789abcdef0123/continue", {"seconds": 2}, None, "no song", status=404)
    assert len(client.get("/v1/songs").json()["songs"]) == 2  # nothing was queued


def test_the_longest_song_a_body_can_reach(server, pipe):
    client = server.client
    answer = client.post("/v1/songs/length", json={**SONG, "seconds": 60}).json()
    longest = pipe.rules.longest_song(SongRequest(SONG["style"], SONG["lyrics"]))
    assert answer["longest"] == {"tokens": longest["tokens"], "seconds": longest["seconds"]}
    assert answer["asked"] == {"tokens": 1500, "seconds": 60.0, "by": "seconds"} and answer["fits"] is True
    assert (answer["context_tokens"], answer["tokens_per_second"], answer["problem"]) == (24576, 25, None)
    over = client.post("/v1/songs/length", json={**SONG, "seconds": longest["seconds"] + 1}).json()
    assert over["fits"] is False and over["problem"].startswith("seconds: the request is too long")
    assert f"lower seconds to at most {longest['seconds']:g}" in over["problem"]
    default = client.post("/v1/songs/length", json=SONG).json()
    assert default["asked"] == {"tokens": 12, "seconds": 0.48, "by": "max_tokens"}
    refused(client, "/v1/songs/length", {**SONG, "seconds": 0.2}, "seconds", "below the semantic phase's min_tokens 12")
    refused(client, "/v1/songs/length", {**SONG, "seconds": 1, "semantic_sampling": {"max_tokens": 20}}, "seconds",
            "seconds and semantic_sampling.max_tokens both set the song's token budget")
    assert client.get("/v1/songs").json()["songs"] == []  # nothing was queued
    # its own resource, though /v1/songs/{job_id} would match the path too: Allow names what the schema documents
    wrong = client.request("PUT", "/v1/songs/length")
    assert (wrong.status_code, wrong.headers["Allow"]) == (405, "POST")
    assert client.request("PUT", "/v1/songs/j1").headers["Allow"] == "DELETE, GET"


def test_a_continue_job_survives_a_restart_from_the_durable_store(pipe, tmp_path):
    """A continue job still queued when the server stops is in the job store with the song it continues: the next
    start runs it, and it is the longer song (the store's record, not the stopped server's memory, names the
    parent)."""
    import json

    from yue2_vllm.serve.errors import RequestInvalid
    from yue2_vllm.serve.store import JobStore
    from yue2_vllm.song.continuation import CONTINUE_KEY

    config = ServeConfig(tmp_path / "data", concurrency=1, shutdown_seconds=5)
    service = SongService(pipe, config)
    service.start()
    try:
        capped, _ = service.submit(json.dumps({**SONG, "seconds": 0.48}).encode())
        longer, _ = service.submit(json.dumps({**SONG, "seconds": 0.8}).encode())
        for record in (capped, longer):
            wait_for(lambda: service.store.get(record.id).status, lambda s: s in FINAL, timeout=180)
        # a song of 3,000 tokens holds the one worker, so the continue job waits in the queue
        blocker, _ = service.submit(json.dumps({**SONG, "semantic_sampling": {"min_tokens": 3000,
                                                                              "max_tokens": 3000}}).encode())
        wait_for(lambda: service.store.get(blocker.id).status, lambda s: s == "generating", timeout=60)
        job, _ = service.continue_song(capped.id, json.dumps({"seconds": 0.8}).encode())
        assert service.store.get(job.id).status == "queued"
        for unfinished, status in ((blocker.id, "generating"), (job.id, "queued")):  # not songs yet: one line each
            with pytest.raises(RequestInvalid, match=f"^job_id: song {unfinished} is {status}; only a finished song "
                                                     "whose cap cut it can continue$") as refused:
                service.continue_song(unfinished, json.dumps({"seconds": 0.8}).encode())
            assert refused.value.field == "job_id"
    finally:
        service.close()
    store = JobStore(config.database)
    assert store.get(job.id).status == "queued" and store.get(job.id).overrides[CONTINUE_KEY]["parent"] == capped.id
    store.update(blocker.id, cancel_requested=1)  # asked before the restart: kept, so the continue job runs next
    store.close()
    server = ThreadServer(SongService(pipe, config))
    try:
        doc = final(server.client, job.id)
        assert doc["status"] == "complete", doc["error"]
        assert doc["continued_from"] == {"id": capped.id, "take": 1} and doc["result"]["continuation"]["exact"]
        assert server.client.get(f"/v1/songs/{job.id}/audio").content == \
            server.client.get(f"/v1/songs/{longer.id}/audio").content
        assert final(server.client, blocker.id)["status"] == "cancelled"
    finally:
        server.stop()


def test_a_server_refuses_to_continue_a_song_made_with_another_configuration(pipe, tiny_model_dir, tiny_vae_dir,
                                                                            tmp_path):
    """The server continues a song on its own pipeline: a song its data dir holds from a server run with another
    generation config (`generate --continue` would read that config from the song's directory) is a 422 naming
    the setting, and nothing is queued."""
    from yue2_vllm.pipeline import YuE2Pipeline

    from serving import GENERATION

    config = ServeConfig(tmp_path / "data", concurrency=1)
    server = ThreadServer(SongService(pipe, config))
    try:
        capped = queue(server.client, **SONG, seconds=0.48)
        assert final(server.client, capped["id"])["status"] == "complete"
    finally:
        server.stop()
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config={**GENERATION, "ode_steps": 3}) as other:
        server = ThreadServer(SongService(other, config))
        try:
            refused(server.client, f"/v1/songs/{capped['id']}/continue", {"seconds": 0.8}, "job_id",
                    "the song was made with ode_steps 2, this pipeline runs 3; continue it with the same generation "
                    "config")
            assert len(server.client.get("/v1/songs").json()["songs"]) == 1  # the parent alone
        finally:
            server.stop()
