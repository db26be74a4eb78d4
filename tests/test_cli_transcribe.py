"""`yue2-vllm transcribe` and the covers of the other commands (cli/transcribe.py): a melody's score and its record
written, its warnings (the drift with its figures) on stderr; `generate --melody-audio`, request files and batch rows
with `melody_audio` rendering the transcribed score byte for byte (cot melody) on the torch backend, the record in
result.json and transcription.json, the song's identity its score's; and every refusal in one line, before any
model loads, with nothing written."""
import json
import sys

import numpy as np
import pytest

from melodies import synthesize, wav_bytes
from test_cli import config_file, model_args  # noqa: F401 (config_file: a fixture)
from test_transcription_pyin import TWINKLE, UP_ABOVE
from yue2_vllm.cli import main

LYRICS = "[verse]\ntwinkle twinkle little star how I wonder what you are\n"
SHORT = "[verse]\nla la\n"  # two syllables for fourteen notes: the syllables warning


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    """Sources by name: a steady hum, one whose tempo drifts, and the audio each refusal is about."""
    folder = tmp_path_factory.mktemp("audio")
    rng = np.random.default_rng(0)
    sources = {
        "hum.wav": wav_bytes(synthesize(TWINKLE, 100, vibrato_semitones=0.2, noise_dbfs=-50)),
        "drift.wav": wav_bytes(synthesize(TWINKLE + UP_ABOVE + [(p + 32, n, q) for p, n, q in TWINKLE], 92,
                                          tempo_end=124, vibrato_semitones=0.2)),
        "notes.txt": b"these are not notes",
        "short.wav": wav_bytes(synthesize([(0, 0.5, 60)], 120, lead_seconds=0.05, tail_seconds=0.05)),
        "silent.wav": wav_bytes(np.zeros(32000, np.float32)),
        "noise.wav": wav_bytes((0.3 * rng.standard_normal(48000)).astype(np.float32)),
        "long.wav": wav_bytes(np.zeros(8000 * 361, np.float32), 8000, subtype="PCM_16"),
    }
    for name, data in sources.items():
        (folder / name).write_bytes(data)
    return folder


def test_transcribe_writes_the_score_and_its_record_and_says_the_drift_on_stderr(audio, tmp_path, capsys):
    from yue2_vllm.transcription import transcribe

    out = tmp_path / "out" / "score.abc"
    assert main(["transcribe", str(audio / "drift.wav"), "--output", str(out), "--lyrics", LYRICS]) == 0
    captured = capsys.readouterr()
    status = json.loads(captured.out)
    expected = transcribe(audio / "drift.wav", lyrics=LYRICS)
    record = json.loads((tmp_path / "out" / "score.transcription.json").read_text())
    assert out.read_text() == expected.abc and record["notes"] == [n.record() for n in expected.notes]
    assert status == {"status": "transcribed", "audio": str(audio / "drift.wav"), "score": str(out),
                      "record": str(tmp_path / "out" / "score.transcription.json"), "transcriber": "pyin",
                      "transcriber_version": expected.transcriber_version, "bpm": expected.bpm, "meter": "4/4",
                      "key": expected.key, "notes": len(expected.notes),
                      "source_seconds": round(expected.source.seconds, 3),
                      "warnings": [w.code for w in expected.warnings], "licence": None,
                      "seconds": status["seconds"]}
    drift = next(w for w in expected.warnings if w.code == "drift")
    assert f"yue2-vllm: warning: {drift.message}\n" in captured.err  # its figures in its words
    assert f"from {expected.tempo.first_beat_off_second:.1f} s a note is more than a beat off" in captured.err
    record_path = tmp_path / "elsewhere.json"
    assert main(["transcribe", str(audio / "hum.wav"), "--output", str(tmp_path / "hum.abc"), "--record",
                 str(record_path), "--bpm", "100"]) == 0
    assert json.loads(record_path.read_text())["request"]["bpm"] == 100 and (tmp_path / "hum.abc").is_file()


REFUSALS = [
    ("notes.txt", [], "{audio}: not audio libsndfile reads (Format not recognised; WAV, FLAC, OGG, MP3 and AIFF are)"),
    ("short.wav", [], "{audio}: 0.35 s is too short (at least 1 s)"),
    ("silent.wav", [], "{audio}: silent (its loudest sample is -inf dBFS, below -60 dBFS)"),
    ("noise.wav", [], "{audio}: no pitched notes: pYIN heard no steady pitch"),
    ("long.wav", [], "{audio}: 361.0 s is too long (at most 360 s for this transcriber)"),
    ("hum.wav", ["--bpm", "500"], "--bpm: 500.0 is outside 30-300 quarter notes a minute"),
    ("hum.wav", ["--meter", "4"], "--meter: '4' is not a meter this transcriber writes"),
    ("hum.wav", ["--key", "H"], "--key: 'H' is not a key the score can name"),
    ("hum.wav", ["--transcriber", "sheetsage2", "--bpm", "90"], "--bpm: sheetsage2 finds the tempo, meter, key and "
                                                                "downbeat itself; bpm is for the pyin transcriber"),
    ("hum.wav", ["--transcriber", "sheetsage2"], "--transcriber: sheetsage2: "),
]


@pytest.mark.parametrize("name,flags,reason", REFUSALS, ids=[r[0] + " ".join(r[1]) for r in REFUSALS])
def test_bad_audio_and_bad_knobs_are_refused_in_one_line_and_nothing_is_written(audio, tmp_path, capsys,
                                                                                monkeypatch, name, flags, reason):
    monkeypatch.setenv("YUE2_SHEETSAGE_PYTHON", str(tmp_path / "no-python"))  # SheetSage2 is not set up here
    out = tmp_path / "out" / "score.abc"
    assert main(["transcribe", str(audio / name), "--output", str(out), *flags]) == 2
    captured = capsys.readouterr()
    status = json.loads(captured.out)
    assert status["status"] == "failed" and status["reason"].startswith(reason.format(audio=audio / name)), status
    assert captured.err == f"yue2-vllm: error: {status['reason']}\n" and "\n" not in status["reason"]
    assert not (tmp_path / "out").exists()


def test_sheetsage2_is_placed_by_the_device_variable_and_the_gpus_free_memory(audio, tmp_path, capsys, monkeypatch,
                                                                              fake_gpu):
    from sheetsage_stand_in import stand_in_model
    from test_transcription_sheetsage import FULL

    out = tmp_path / "score.abc"
    # an operator's $YUE2_SHEETSAGE_DEVICE=off turns it off (its weights are non-commercial)
    monkeypatch.setenv("YUE2_SHEETSAGE_DEVICE", "off")
    assert main(["transcribe", str(audio / "hum.wav"), "--output", str(out), "--transcriber", "sheetsage2"]) == 2
    assert json.loads(capsys.readouterr().out)["reason"].startswith("--transcriber: sheetsage2: turned off here")
    monkeypatch.setenv("YUE2_SHEETSAGE_DEVICE", "gpu")
    assert main(["transcribe", str(audio / "hum.wav"), "--output", str(out), "--transcriber", "sheetsage2"]) == 2
    assert json.loads(capsys.readouterr().out)["reason"] == \
        "--transcriber: sheetsage2: $YUE2_SHEETSAGE_DEVICE='gpu' is not a device (one of auto, cuda, cpu, off)"
    # auto: the command weighs this machine's free GPU memory (a stand-in model; its worker's torch sees no GPU and
    # runs on the CPU, saying so)
    monkeypatch.setenv("YUE2_SHEETSAGE_DEVICE", "auto")
    monkeypatch.setenv("YUE2_SHEETSAGE_PYTHON", sys.executable)
    monkeypatch.setenv("YUE2_SHEETSAGE_MODEL", str(stand_in_model(tmp_path / "model", FULL)))
    gpu = fake_gpu("H100")
    assert main(["transcribe", str(audio / "hum.wav"), "--output", str(out), "--transcriber", "sheetsage2"]) == 0
    details = json.loads((tmp_path / "score.transcription.json").read_text())["details"]
    assert details["placement"] == f"{gpu['free'] / 2 ** 30:.1f} GiB free beside the engine (at least 8 GiB needed)"
    assert "this environment's torch sees no CUDA device: ran on the CPU in fp32" in capsys.readouterr().err


def test_generate_renders_a_hum_byte_for_byte_as_the_songs_score_whose_identity_is_the_scores(
        tiny_model_dir, tiny_vae_dir, config_file, audio, tmp_path, capsys):  # noqa: F811
    from yue2_vllm.transcription import transcribe

    expected = transcribe(audio / "hum.wav", lyrics=SHORT)
    common = [*model_args(tiny_model_dir, tiny_vae_dir, config_file), "--quiet", "--style", "pop, piano",
              "--lyrics", SHORT, "--seed", "3", "--id", "cover"]
    assert main(["generate", *common, "--melody-audio", str(audio / "hum.wav"), "--output",
                 str(tmp_path / "runs")]) == 0
    captured = capsys.readouterr()
    status, song = json.loads(captured.out), tmp_path / "runs" / "cover"
    request = json.loads((song / "request.json").read_text())
    assert (song / "score.abc").read_bytes() == expected.abc.encode() and request["abc"] == expected.abc
    assert request["cot"] == "melody" and request["transcription"] == {**expected.summary(), "edited": False}
    result = json.loads((song / "result.json").read_text())
    assert result["transcription"] == request["transcription"] and status["status"] == "complete"
    assert status["transcription"]["warnings"] == [w.code for w in expected.warnings] == ["syllables"]
    record = json.loads((song / "transcription.json").read_text())
    assert record["notes"] == [n.record() for n in expected.notes] and record["request"]["lyrics"] == SHORT
    assert f"yue2-vllm: warning: {expected.warnings[0].message}\n" in captured.err
    # the same score given as a file is the same song: the record is left out of its identity
    assert main(["generate", *common, "--abc-file", str(song / "score.abc"), "--cot", "melody", "--output",
                 str(tmp_path / "plain")]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["identity"] == status["identity"] == result["identity"]
    assert "transcription" not in json.loads((tmp_path / "plain" / "cover" / "result.json").read_text())


def test_a_cover_is_refused_before_any_model_loads(audio, tmp_path, capsys):
    (tmp_path / "score.abc").write_text("X:1\nK:C\nC|\n")
    (tmp_path / "with-abc.json").write_text(json.dumps({"style": "pop", "lyrics": "la", "abc_path": "score.abc"}))
    (tmp_path / "silent.json").write_text(json.dumps({"style": "pop", "lyrics": "la", "melody_audio": "silent.wav",
                                                      "melody": {"bpm": 90}}))
    (tmp_path / "silent.wav").write_bytes((audio / "silent.wav").read_bytes())
    (tmp_path / "bpm.json").write_text(json.dumps({"style": "pop", "lyrics": "la", "melody_audio": "silent.wav",
                                                   "melody": {"bpm": 900}}))
    hum = str(audio / "hum.wav")
    song = ["--style", "pop", "--lyrics", "la", "--output", str(tmp_path / "runs")]
    for argv, reason in (
            ([*song, "--melody-audio", hum, "--abc-file", str(tmp_path / "score.abc")],
             "--abc-file: give --abc-file or a melody to transcribe (--melody-audio), not both"),
            ([*song, "--melody-audio", hum, "--cot", "full"],
             "--cot: a cover renders its transcribed melody with cot 'melody', got 'full'"),
            ([*song, "--bpm", "90"], "--bpm: sets how --melody-audio is transcribed; give --melody-audio"),
            ([*song, "--melody-audio", hum, "--seed", "-1"], "--seed: SongRequest.seed must be an integer"),
            (["--request", str(tmp_path / "with-abc.json"), "--melody-audio", hum, "--output", str(tmp_path / "runs")],
             f"--melody-audio: --request {tmp_path / 'with-abc.json'} gives the song's score ('abc')"),
            ([*song, "--melody-audio", str(audio / "notes.txt")],
             f"--melody-audio {audio / 'notes.txt'}: not audio libsndfile reads"),
            (["--request", str(tmp_path / "silent.json"), "--output", str(tmp_path / "runs")],
             f"--request {tmp_path / 'silent.json'}: melody_audio {tmp_path / 'silent.wav'}: silent"),
            (["--request", str(tmp_path / "bpm.json"), "--output", str(tmp_path / "runs")],
             f"--request {tmp_path / 'bpm.json'}: melody.bpm: 900 is outside 30-300"),
            (["--continue", str(tmp_path), "--seconds", "5", "--melody-audio", hum],
             "--melody-audio: --continue goes on with the song's own request")):
        assert main(["generate", *argv]) == 2, argv
        status = json.loads(capsys.readouterr().out)
        assert status["reason"].startswith(reason), (argv, status)
    assert not (tmp_path / "runs").exists()


def test_batch_rows_with_melody_audio_are_covers_and_a_bad_one_fails_alone(
        tiny_model_dir, tiny_vae_dir, config_file, audio, tmp_path, capsys):  # noqa: F811
    for name in ("hum.wav", "silent.wav"):
        (tmp_path / name).write_bytes((audio / name).read_bytes())
    rows = [{"id": "hum", "style": "pop", "lyrics": SHORT, "melody_audio": "hum.wav", "melody": {"bpm": 100}},
            {"id": "quiet", "style": "pop", "lyrics": "la", "melody_audio": "silent.wav"},
            {"id": "both", "style": "pop", "lyrics": "la", "melody_audio": "hum.wav", "abc": "X:1\n"},
            {"id": "again", "style": "rock", "lyrics": SHORT, "melody_audio": "hum.wav", "melody": {"bpm": 100}}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    assert main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), "--quiet", "--cot", "full",
                 "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    summary = json.loads((tmp_path / "out" / "batch.json").read_text())
    assert [r["status"] for r in summary["results"]] == ["complete", "failed", "failed", "complete"]
    assert summary["results"][1]["reason"].startswith(f"{tmp_path / 'in.jsonl'}:2: row: melody_audio "
                                                      f"{tmp_path / 'silent.wav'}: silent")
    assert "give 'melody_audio' or 'abc', not both" in summary["results"][2]["reason"]
    for song in ("hum", "again"):  # one melody, transcribed once (its warning told once), two covers of it
        request = json.loads((tmp_path / "out" / song / "request.json").read_text())
        assert request["cot"] == "melody" and request["transcription"]["bpm"] == 100
        assert (tmp_path / "out" / song / "score.abc").read_text() == request["abc"]
        assert json.loads((tmp_path / "out" / song / "transcription.json").read_text())["request"]["bpm"] == 100
    assert captured.err.count("yue2-vllm: warning: ") == 1 and "in.jsonl:1: syllables:" in captured.err


def test_a_sheetsage2_cover_shows_its_licence_where_it_is_used(tiny_model_dir, tiny_vae_dir, config_file, audio,
                                                               tmp_path, capsys, monkeypatch):  # noqa: F811
    """Through SheetSage2's worker with the tests' stand-in for its gated weights (our python runs it): the licence a
    line on stderr and in the song's record, beside its warnings."""
    import sys

    from sheetsage_stand_in import stand_in_model
    from test_transcription_sheetsage import FULL, MELODY
    from yue2_vllm.transcription.sheetsage import LICENCE

    monkeypatch.setenv("YUE2_SHEETSAGE_PYTHON", sys.executable)
    monkeypatch.setenv("YUE2_SHEETSAGE_MODEL", str(stand_in_model(tmp_path / "SheetSage2-merged", FULL,
                                                                  beats=[0.5 + 0.625 * k for k in range(24)])))
    assert main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), "--quiet", "--style", "pop",
                 "--lyrics", "[verse]\n" + "la " * 13, "--melody-audio", str(audio / "hum.wav"), "--transcriber",
                 "sheetsage2", "--output", str(tmp_path / "runs"), "--id", "mix"]) == 0
    captured = capsys.readouterr()
    assert f"yue2-vllm: licence: the score was transcribed by sheetsage2: {LICENCE}\n" in captured.err
    assert "yue2-vllm: warning: SheetSage2: low confidence in bar 3\n" in captured.err
    result = json.loads((tmp_path / "runs" / "mix" / "result.json").read_text())
    assert result["transcription"]["licence"] == LICENCE == json.loads(captured.out)["transcription"]["licence"]
    assert (tmp_path / "runs" / "mix" / "score.abc").read_text() == MELODY
