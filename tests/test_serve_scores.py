"""Scores over HTTP on a real uvicorn server (serve/routes/scores.py, and files' score.mid): POST /v1/scores/check
answers the upstream-exact reader's verdict (the music, or one line naming the score line), POST /v1/scores/midi
and GET /v1/songs/{id}/score.mid (a take's too) the MIDI file; a body that is not {"abc": text} is refused naming
the field, and a song whose score does not read (the tiny model writes random text) has no MIDI (409 naming the
line)."""
import pytest

from yue2_vllm.midi import midi_file
from yue2_vllm.score_notes import check_score, score_notes
from yue2_vllm.serve.service import ServeConfig, SongService

from serving import ThreadServer, pipe, wait_for  # noqa: F401 (pipe: a fixture)
from test_instrumental import SCORE

KEY = "scores-test-key-0123456789"
SONG = {"style": "pop, piano", "lyrics": "[verse]\nla la la\n", "seed": 7}
BROKEN = SCORE.replace("B8d8g16|", "B8d8g8|")  # line 13: a bar of 3 quarters in 4/4


@pytest.fixture(scope="module")
def server(pipe, tmp_path_factory):
    server = ThreadServer(SongService(pipe, ServeConfig(tmp_path_factory.mktemp("scores") / "data", concurrency=1)),
                          api_key=KEY)
    server.client.headers["Authorization"] = f"Bearer {KEY}"
    yield server
    server.stop()


def final(client, job_id) -> dict:
    return wait_for(lambda: client.get(f"/v1/songs/{job_id}").json(),
                    lambda d: d["status"] in ("complete", "failed", "cancelled"), 180)


def queue(client, **body) -> str:
    response = client.post("/v1/songs", json=body)
    assert response.status_code == 202, response.text
    doc = final(client, response.json()["id"])
    assert doc["status"] == "complete", doc["error"]
    return doc["id"]


def test_check_answers_the_readers_verdict(server):
    client = server.client
    valid = client.post("/v1/scores/check", json={"abc": SCORE})
    assert valid.status_code == 200 and valid.json() == check_score(SCORE)
    assert valid.json()["score"]["cot"] == "full" and valid.json()["score"]["bars"] == 4
    for text, line in ((BROKEN, 13), ("", 1), ("X:1\nT:\nK:C\n", 3)):
        answer = client.post("/v1/scores/check", json={"abc": text})
        assert answer.status_code == 200, answer.text
        verdict = answer.json()
        assert (verdict["valid"], verdict["line"], verdict["score"]) == (False, line, None)
        assert verdict["problem"].startswith(f"score line {line}: ") and "\n" not in verdict["problem"]
    assert client.post("/v1/scores/check", json={"abc": BROKEN}).json()["problem"] == (
        "score line 13: group 1, Ins, bar 1: the bar holds 3 quarter notes, its meter 4/4 takes 4")


def test_a_body_that_is_not_a_score_is_refused_naming_the_field(server):
    client = server.client
    for path in ("/v1/scores/check", "/v1/scores/midi"):
        for body, field, words in (({}, "abc", "abc: missing"), ({"abc": 3}, "abc", "abc: must be a string, got int"),
                                   ({"abc": SCORE, "cot": "full"}, "cot", "unknown field(s) ['cot']"),
                                   ([SCORE], None, "body: must be a JSON object, got list")):
            answer = client.post(path, json=body)
            assert answer.status_code == 422, (path, body, answer.text)
            assert answer.json()["error"]["field"] == field and words in answer.json()["error"]["message"]
        plain = client.post(path, content=SCORE.encode(), headers={"Content-Type": "text/plain"})
        assert (plain.status_code, plain.json()["error"]["field"]) == (415, "Content-Type")
        huge = client.post(path, json={"abc": "x" * (300 * 1024)})
        assert huge.status_code == 413
        assert client.post(path, json={"abc": SCORE}, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_midi_of_a_checked_score(server):
    client = server.client
    answer = client.post("/v1/scores/midi", json={"abc": SCORE})
    assert answer.status_code == 200 and answer.headers["content-type"] == "audio/midi"
    assert answer.headers["content-disposition"] == 'attachment; filename="score.mid"'
    assert answer.content == midi_file(score_notes(SCORE)) and answer.content.startswith(b"MThd")
    refused = client.post("/v1/scores/midi", json={"abc": BROKEN})
    assert refused.status_code == 422
    assert refused.json()["error"] == {"status": 422, "field": "abc", "message": "abc: score line 13: group 1, Ins, "
                                       "bar 1: the bar holds 3 quarter notes, its meter 4/4 takes 4"}


def test_a_songs_score_as_midi_and_a_takes(server):
    client = server.client
    given = queue(client, **SONG, abc=SCORE, id="ballad", stage="plan")
    assert client.get(f"/v1/songs/{given}/score").text == SCORE
    midi = client.get(f"/v1/songs/{given}/score.mid")
    assert midi.status_code == 200 and midi.content == midi_file(score_notes(SCORE))
    assert midi.headers["content-disposition"] == 'attachment; filename="ballad.mid"'
    takes = queue(client, **SONG, abc=SCORE, takes=2)
    wait_for(lambda: client.get(f"/v1/songs/{takes}").json(),
             lambda d: all(e["status"] == "complete" for e in d["takes"]["entries"]), 180)
    second = client.get(f"/v1/songs/{takes}/takes/2/score.mid")
    assert second.status_code == 200 and second.content == midi.content
    take = client.get(f"/v1/songs/{takes}/takes/2").json()
    assert second.headers["content-disposition"] == f'attachment; filename="{take["label"] or take["id"]}.mid"'
    assert client.get(f"/v1/songs/{takes}/takes/3/score.mid").status_code == 404

    planned = queue(client, **SONG, stage="plan")  # the tiny model's own score: random text, not the dialect
    text = client.get(f"/v1/songs/{planned}/score").text
    refused = client.get(f"/v1/songs/{planned}/score.mid")
    assert refused.status_code == 409
    assert refused.json()["error"]["message"] == ("the song's score does not read, so it has no MIDI: "
                                                  + check_score(text)["problem"])
    silent = queue(client, **SONG, cot="off")
    assert client.get(f"/v1/songs/{silent}/score.mid").status_code == 404  # cot off writes no score
    assert client.get("/v1/songs/j0123456789abcdef0123/score.mid").status_code == 404
