"""The instrumental switch: upstream's score edit pinned on hand-written native scores, and songs end to end."""
import json
from fractions import Fraction
from types import SimpleNamespace

import pytest

from yue2_vllm.instrumental import (PLANNING_LYRICS, ScoreError, edit_score, instrumental_style, lyric_tags,
                                    plan_steps, read_score)
from yue2_vllm.protocol import SongRequest
from yue2_vllm.request_json import UsageError, request_from_json
from yue2_vllm.options import AROptions, EngineOptions, LoadOptions

HEADER = ('X:1\nT:\nM:4/4\nL:1/32\nQ:1/4=100\nV: Vocal clef=treble name="Vocal Melody" snm="Vocal"\n'
          'V: Ins clef=treble name="Ins Melody" snm="Inst."\nK:G\n')
# Two groups: an intro where only Ins plays (and Vocal holds a chord over rests), a verse where Vocal sings over Ins.
SCORE = HEADER + ('% intro\nV: Vocal\n"G"z32|Z|\nV: Ins\nB8d8g16|e32|\n'
                  '% verse\nV: Vocal\n"G"z8B8d16-|"C"d8^c8=c16|\nV: Ins\nG16A16|B32|\n')
EDITED = HEADER + ('% intro\nV: Vocal\n"G"z32|Z|\nV: Ins\nB8d8g16|e32|\n'
                   '% verse\nV: Vocal\n"G"z32|"C"z32|\nV: Ins\nG8B8d16-|d8^c8=c16|\n')


def test_vocal_notes_move_to_ins_where_the_vocal_wins_and_vocal_keeps_its_chords():
    edit = edit_score(SCORE)
    assert edit.text == EDITED
    score = read_score(edit.text)
    assert score.voices["Vocal"].notes == []
    assert score.voices["Vocal"].chords == [(0, "G"), (8, "G"), (12, "C")]
    # The verse's Ins G (beat 1-2) keeps the half before the vocal B enters; its A and B are under the vocal line.
    assert score.voices["Ins"].notes[4:] == [[8, 67, 1], [9, 71, 1], [10, 74, 3], [13, 73, 1], [14, 72, 2]]
    changes = edit.changes
    assert (changes["vocal_notes_moved_to_ins"], changes["ins_notes_before"], changes["ins_notes_unchanged"],
            changes["ins_notes_after"]) == (4, 7, 4, 9)
    assert [t["ins_note"] for t in changes["ins_notes_trimmed_under_vocal"]] == [4, 5, 6]
    assert changes["ins_notes_trimmed_under_vocal"][0]["kept"] == [["8", "1"]]
    assert changes["render_cot"] == "full" and changes["lines_changed"] == [16, 18]
    assert changes["nominal_seconds"] == 9.6


def test_the_edit_is_idempotent_and_reads_crlf_as_upstream_does():
    assert edit_score(EDITED).text == EDITED
    crlf = edit_score(SCORE.replace("\n", "\r\n"))
    assert crlf.text == EDITED and crlf.changes["line_endings"] == "crlf read as lf"


def test_a_score_without_chords_renders_as_melody_and_accidentals_follow_the_bar():
    score = HEADER.replace("K:G", "K:F") + "% verse\nV: Vocal\n=B8_B8B8c8|\nV: Ins\nZ|\n"
    edit = edit_score(score)
    assert edit.cot == "melody"
    assert edit.text.endswith("V: Vocal\nZ|\nV: Ins\n=B8_B8B8c8|\n")  # in F, B is flat; a mark holds to the bar end
    assert [n[1] for n in read_score(edit.text).voices["Ins"].notes] == [71, 70, 70, 72]


def test_a_multi_group_score_with_a_meter_change_and_a_silent_vocal_keeps_its_grid():
    score = HEADER + ('% intro\nV: Vocal\nZ2|\nV: Ins\nG32|A32|\n'
                      '% chorus\nV: Vocal\nM:3/4\nd24|\nV: Ins\nM:3/4\nB24|\n')
    edit = edit_score(score)
    assert edit.text == HEADER + ('% intro\nV: Vocal\nZ2|\nV: Ins\nG32|A32|\n'
                                  '% chorus\nV: Vocal\nM:3/4\nZ|\nV: Ins\nM:3/4\nd24|\n')
    assert lyric_tags(edit.text) == "[Intro]\n\n[Chorus]\n"


@pytest.mark.parametrize("score,line,words", [
    (SCORE.replace('V: Vocal clef=treble name="Vocal Melody" snm="Vocal"\n', ""), 6, "Vocal voice definition"),
    (SCORE.replace("V: Ins clef", "V: Piano clef"), 7, "Ins voice definition"),
    (SCORE.replace("% intro\n", "%%MIDI program 0\n"), 9, "expected 'V: Vocal'"),
    (SCORE.replace("G16A16|B32|\n", "G16A16|B32|\nw: la la\n"), 19, "expected 'V: Vocal'"),
    (SCORE.replace("B8d8g16|", "B8d8g8|"), 13, "holds 3 quarter notes, its meter 4/4 takes 4"),
    (SCORE.replace("e32|\n", "e32\n"), 13, "must end with a plain barline"),
    (SCORE.replace("K:G", "K:H"), 8, "unsupported key"),
    (SCORE.replace("B8d8g16|", "(3B8d8g8z8|"), 13, "tuplet"),
])
def test_a_malformed_score_is_refused_naming_its_line(score, line, words):
    with pytest.raises(ScoreError, match=rf"^score line {line}: .*{words}"):
        edit_score(score)


def test_a_score_with_no_sounding_notes_is_refused():
    with pytest.raises(ScoreError, match="no sounding notes"):
        edit_score(HEADER + "% intro\nV: Vocal\nZ|\nV: Ins\nZ|\n")


def test_upstreams_style_and_tags():
    assert instrumental_style("pop, piano.") == "Instrumental, pop, piano, no vocals, no singing, no choir, " \
                                                "no spoken words."
    assert instrumental_style("instrumental jazz, no vocals") == "instrumental jazz, no vocals, no singing, " \
                                                                 "no choir, no spoken words."
    assert instrumental_style(instrumental_style("rock")) == instrumental_style("rock")
    assert lyric_tags("X:1\n% pre-chorus\n") == "[Pre-Chorus]\n" and lyric_tags("X:1\n") == ""


def test_the_steps_plan_with_upstreams_tags_then_render_the_edit():
    asked = []

    def plan_score(request):
        asked.append(request)
        return SimpleNamespace(abc=SCORE, truncated=False, timing={"seconds": 1.5, "mean_logprob": -2.0})

    steps = plan_steps(SongRequest("pop", "", instrumental=True, seed=5), plan_score)
    assert asked[0].lyrics == PLANNING_LYRICS and asked[0].cot == "full" and asked[0].seed == 5
    assert not asked[0].instrumental and asked[0].style == "pop"
    render = steps.render
    assert (render.abc, render.cot, render.lyrics, render.seed) == (EDITED, "full", "[Intro]\n\n[Verse]\n", 5)
    assert render.style == instrumental_style("pop") and not render.instrumental
    record = steps.record()
    assert record["planned_by"] == "model" and record["render_request"]["abc"] == EDITED
    with pytest.raises(ValueError, match="truncated"):
        plan_steps(SongRequest("pop", "", instrumental=True),
                   lambda r: SimpleNamespace(abc=SCORE, truncated=True, timing={}))
    with pytest.raises(ScoreError, match="^the planned score line 1"):
        plan_steps(SongRequest("pop", "", instrumental=True),
                   lambda r: SimpleNamespace(abc="la la", truncated=False, timing={}))


def test_the_request_field():
    assert SongRequest("pop", "", instrumental=True).to_dict()["instrumental"] is True
    assert "instrumental" not in SongRequest("pop", "la").to_dict()  # other songs keep their identity
    with pytest.raises(ValueError, match="SongRequest.instrumental must be true or false, got 'yes'"):
        SongRequest("pop", "la", instrumental="yes")
    with pytest.raises(ValueError, match="SongRequest.instrumental needs cot 'full' or 'melody'"):
        SongRequest("pop", "la", cot="off", instrumental=True)
    with pytest.raises(ValueError, match="^SongRequest.abc: score line 6"):
        SongRequest("pop", "", abc=SCORE.replace('V: Vocal clef', 'V: Lead clef'), instrumental=True)
    with pytest.raises(ValueError, match="SongRequest.lyrics must be non-blank"):
        SongRequest("pop", "")
    fields, _ = request_from_json({"style": "pop", "instrumental": True})
    assert fields["lyrics"] == "" and SongRequest(**fields).instrumental
    with pytest.raises(UsageError, match="lyrics must be non-blank text when given"):
        request_from_json({"style": "pop", "lyrics": "", "instrumental": True})
    with pytest.raises(ValueError, match="SongRequest.instrumental must be true or false, got 1"):
        SongRequest(**request_from_json({"style": "pop", "lyrics": "la", "instrumental": 1})[0])


GENERATION = {"abc": {"max_tokens": 10, "min_tokens": 4}, "semantic": {"max_tokens": 30, "min_tokens": 10},
              "ode_steps": 4}


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    from yue2_vllm.checkpoint import HashCache
    from yue2_vllm.pipeline import YuE2Pipeline

    cache = HashCache(tmp_path_factory.mktemp("hashes") / "cache.json")
    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        load=LoadOptions(hash_cache=cache))


def test_an_instrumental_song_on_the_torch_backend_records_each_step_and_resumes(pipe, tmp_path):
    request = SongRequest("piano pop", "", abc=SCORE, instrumental=True, seed=3, id="inst")
    planned = pipe.generate_to(tmp_path / "inst", request, stage="plan")
    assert planned["status"] == "planned" and planned["abc"] == EDITED
    record = json.loads((tmp_path / "inst" / "instrumental.json").read_text())
    assert (tmp_path / "inst" / "planned.abc").read_text() == SCORE
    assert (tmp_path / "inst" / "score.abc").read_text() == EDITED
    assert record["changes"]["vocal_notes_moved_to_ins"] == 4 and record["planned_by"] == "request"
    document = pipe.generate_to(tmp_path / "inst", request, resume=True)
    assert document["status"] == "complete" and document["stages_reused"] == ["plan"]
    render = SongRequest.from_dict(record["render_request"])
    direct = pipe(render)  # the song is the edited score rendered as upstream's recipe asks
    tokens = __import__("numpy").load(tmp_path / "inst" / "semantic.npy").tolist()
    assert tokens == direct.semantic.tokens
    again = pipe.generate_to(tmp_path / "inst", request, resume=True)
    assert again["resumed"] is True


def test_a_planned_instrumental_whose_score_is_truncated_fails_its_plan_as_upstream_stops(pipe, tmp_path):
    request = SongRequest("piano pop", "", instrumental=True, seed=3, id="bad")
    with pytest.raises(ValueError, match="the planned score was truncated; upstream's recipe stops here"):
        pipe.generate_to(tmp_path / "bad", request)  # the tiny model's 10-token score is cut off
    state = json.loads((tmp_path / "bad" / "run_state.json").read_text())
    assert state["state"] == "plan_failed" and not (tmp_path / "bad" / "score.abc").exists()


# --------------------------------------------------------------------------- the CLI, batch rows and vLLM

from test_cli import FAST, config_file, model_args  # noqa: E402,F401 (config_file: a fixture)


def test_generate_instrumental_takes_resume_and_refusals(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                         capsys):
    from yue2_vllm.cli import main

    models = model_args(tiny_model_dir, tiny_vae_dir, config_file)
    (tmp_path / "score.abc").write_bytes(SCORE.replace("\n", "\r\n").encode())
    song = ["--style", "piano", "--instrumental", "--abc-file", str(tmp_path / "score.abc"), "--seed", "7",
            "--id", "i"]
    assert main(["generate", *models, *FAST, *song, "--takes", "2", "--best-of", "--output", str(tmp_path / "o")]) == 0
    root = tmp_path / "o" / "i"
    listing = json.loads((root / "takes.json").read_text())
    assert listing["complete"] == [1, 2] and listing["pick"] in (1, 2)
    for directory in (root, root / "takes" / "2"):
        assert (directory / "score.abc").read_text() == EDITED
        assert (directory / "planned.abc").read_bytes() == SCORE.replace("\n", "\r\n").encode()
        record = json.loads((directory / "instrumental.json").read_text())
        assert record["changes"]["line_endings"] == "crlf read as lf"
        assert json.loads((directory / "request.json").read_text())["instrumental"] is True
    capsys.readouterr()
    assert main(["generate", *models, *FAST, *song, "--takes", "2", "--resume", "--output", str(tmp_path / "o")]) == 0
    assert all(json.loads(line)["resumed"] for line in capsys.readouterr().out.strip().splitlines()[:2])
    assert main(["generate", *models, *FAST, "--style", "piano", "--instrumental", "--cot", "off",
                 "--output", str(tmp_path / "p")]) == 2
    assert "instrumental needs cot 'full' or 'melody'" in capsys.readouterr().err
    (tmp_path / "bad.abc").write_text(SCORE.replace("K:G", "K:H"))
    assert main(["generate", *models, *FAST, "--style", "piano", "--instrumental", "--abc-file",
                 str(tmp_path / "bad.abc"), "--output", str(tmp_path / "p")]) == 2
    assert "--abc-file: SongRequest.abc: score line 8: unsupported key 'H'" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_batch_rows_take_the_switch_and_name_a_non_boolean(tiny_model_dir, tiny_vae_dir, config_file, tmp_path):
    from yue2_vllm.cli import main

    rows = [{"id": "a", "style": "pop", "abc": SCORE, "instrumental": True},
            {"id": "b", "style": "pop", "lyrics": "la", "instrumental": "yes"}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")]) == 1
    a, b = json.loads((tmp_path / "out" / "batch.json").read_text())["results"]
    assert a["status"] == "complete" and (tmp_path / "out" / "a" / "score.abc").read_text() == EDITED
    assert b["status"] == "failed" and "instrumental must be true or false, got 'yes'" in b["reason"]


from yue2_vllm.engine.backend import vllm_version  # noqa: E402


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_an_instrumental_song_on_vllm_is_its_render_request_song(tiny_model_dir, tiny_vae_dir, tmp_path):
    from yue2_vllm.pipeline import YuE2Pipeline

    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="vllm")) as pipe:
        request = SongRequest("jazz", "", abc=SCORE, instrumental=True, seed=9, id="v")
        document = pipe.generate_to(tmp_path / "v", request)
        assert document["status"] == "complete"
        assert document["timing"]["semantic"]["backend_actual"] == "vllm"
        render = SongRequest.from_dict(json.loads((tmp_path / "v" / "instrumental.json").read_text())["render_request"])
        assert render.style == "Instrumental, jazz, no vocals, no singing, no choir, no spoken words."
        assert render.cot == "full" and render.lyrics == "[Intro]\n\n[Verse]\n"
        direct = pipe(render)
        import numpy as np

        assert np.load(tmp_path / "v" / "semantic.npy").tolist() == direct.semantic.tokens


def test_the_post_body_names_the_field_it_refuses(pipe):
    from yue2_vllm.serve.submission import RequestInvalid, parse_submission

    def refused(body: dict):
        with pytest.raises(RequestInvalid) as caught:
            parse_submission(pipe, json.dumps(body).encode(), "j" + "0" * 20)
        return caught.value.field, caught.value.message

    assert refused({"style": "pop", "lyrics": "la", "instrumental": "yes"}) == \
        ("instrumental", "instrumental must be true or false, got 'yes'")
    field, message = refused({"style": "pop", "instrumental": True, "cot": "off"})
    assert field == "instrumental" and "needs cot 'full' or 'melody'" in message
    field, message = refused({"style": "pop", "instrumental": True, "abc": SCORE.replace("T:\n", "T:x\n")})
    assert field == "abc" and message.startswith("abc: score line 2: expected a blank title T:")
    assert refused({"style": "pop", "instrumental": True, "lyrics": ""})[0] == "lyrics"
    assert refused({"style": "pop"}) == ("lyrics", "lyrics: missing")
    job = parse_submission(pipe, json.dumps({"style": "pop", "instrumental": True, "stage": "plan",
                                             "takes": 2}).encode(), "j" + "1" * 20)
    assert job.request.instrumental and job.request.lyrics == "" and job.takes.takes == 2


def test_a_take_given_take_ones_edited_score_renders_that_same_score():
    from yue2_vllm.takes import take_request

    first = plan_steps(SongRequest("pop", "", instrumental=True, seed=5),
                       lambda r: SimpleNamespace(abc=SCORE, truncated=False, timing={}))
    shared = take_request(SongRequest("pop", "", instrumental=True, seed=5), 2, abc=first.edit.text)
    second = plan_steps(shared, lambda r: pytest.fail("a shared score is not planned again"))
    assert second.render.abc == first.render.abc and second.render.style == first.render.style
    assert second.render.seed == 6 and second.record()["planned_by"] == "request"
    assert second.edit.changes["vocal_notes_moved_to_ins"] == 0


def test_a_cancelled_instrumental_song_keeps_its_steps_and_resumes_to_the_same_song(pipe, tmp_path):
    request = SongRequest("piano pop", "", abc=SCORE, instrumental=True, seed=5, id="c")
    tokens = []
    with pytest.raises(InterruptedError):
        pipe.generate_to(tmp_path / "c", request, on_token=lambda phase, token: tokens.append(phase),
                         cancelled=lambda: tokens.count("semantic") >= 4)
    assert json.loads((tmp_path / "c" / "run_state.json").read_text())["state"] == "cancelled"
    assert (tmp_path / "c" / "score.abc").read_text() == EDITED and (tmp_path / "c" / "planned.abc").exists()
    document = pipe.generate_to(tmp_path / "c", request, resume=True)
    assert document["status"] == "complete" and document["stages_reused"] == ["plan"]
    whole = pipe.generate_to(tmp_path / "whole", request)
    numpy = __import__("numpy")
    assert numpy.load(tmp_path / "c" / "semantic.npy").tolist() == numpy.load(tmp_path / "whole" / "semantic.npy").tolist()


@pytest.mark.slow  # a batch-invariant (float32) engine of its own; CI runs -m slow
@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_under_reproducible_an_instrumental_song_is_its_seeds_song_whatever_else_the_engine_serves(
        tiny_model_dir, tiny_vae_dir, tmp_path):
    import numpy as np

    from yue2_vllm.pipeline import YuE2Pipeline
    from yue2_vllm.scheduler import generate_many

    mine = SongRequest("jazz", "", abc=SCORE, instrumental=True, seed=21, id="mine")
    others = [SongRequest("pop", f"la la {i}", seed=i, id=f"o{i}", cot="off") for i in range(4)]
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                      ar=AROptions(backend="vllm", reproducible=True),
                      engine=EngineOptions(max_num_seqs=8, max_num_batched_tokens=64)) as pipe:
        alone = generate_many(pipe, [mine], tmp_path / "alone", concurrency=1)
        together = generate_many(pipe, [mine, *others], tmp_path / "together", concurrency=5)
    assert {h.state for h in [*alone, *together]} == {"complete"}
    one, many = tmp_path / "alone" / "mine", tmp_path / "together" / "mine"
    assert np.array_equal(np.load(one / "semantic.npy"), np.load(many / "semantic.npy"))
    document = json.loads((many / "result.json").read_text())
    assert document["batch_invariant"] is True and "batch_note" not in document, document.get("batch_note")
    assert (many / "score.abc").read_text() == EDITED
