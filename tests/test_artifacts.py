import json

import pytest

from yue2_vllm.artifacts import CLAIMED_STAGES, STAGES, STATE_BEFORE, ResumeError, RunDirectory


def _run_with(tmp_path, state: str, identity: str = "run", records=()) -> RunDirectory:
    run = RunDirectory(tmp_path / "s")
    run.path.mkdir()
    run.set_state(identity, {}, state)
    for stage in records:
        run.write_stage(stage, identity, {f"{stage}.bin": b"x"}, {})
    return run


def test_every_run_state_says_which_stages_it_claims():
    from yue2_vllm.pipeline import FAILED_STATES

    assert set(FAILED_STATES.values()) | {"created", "planned", "semantic_generated", "synthesized", "complete",
                                          "cancelled"} == set(CLAIMED_STAGES)
    for stage, before in STATE_BEFORE.items():  # the state before a stage claims exactly the earlier stages
        assert CLAIMED_STAGES[before] == STAGES[:STAGES.index(stage)]


@pytest.mark.parametrize("state,records,problem", [
    ("synthesized", STAGES[:3], None),
    ("cancelled", (), None),
    ("decode_failed", STAGES[:2], "state 'decode_failed' claims the synthesis stage, which has no record of this run"),
    ("planned", (), "state 'planned' claims the plan stage, which has no record of this run"),
])
def test_a_manifest_is_consistent_when_its_stages_have_records(tmp_path, state, records, problem):
    run = _run_with(tmp_path, state, records=records)
    assert run.manifest_problem(run.state()) == problem


def test_an_inconsistent_manifest_is_dropped_a_consistent_one_of_another_run_refused(tmp_path, caplog):
    run = _run_with(tmp_path, "semantic_generated", identity="old", records=STAGES[:2])
    with pytest.raises(ResumeError, match="different request"):
        run.start("new", {}, resume=True)
    (run.path / "semantic.stage.json").unlink()
    with caplog.at_level("WARNING", logger="yue2_vllm"):
        assert run.start("new", {}, resume=True) is False  # nothing of the earlier run is continued
    assert [r.getMessage() for r in caplog.records] == [
        f"{run.path}: run_state.json is inconsistent (state 'semantic_generated' claims the semantic stage, which "
        "has no record of this run); discarding it and redoing every stage"]
    assert not (run.path / "plan.stage.json").exists()
    assert json.loads((run.path / "run_state.json").read_text(encoding="utf-8"))["identity"] == "new"


def test_a_reused_result_says_resumed_and_every_stage_reused(tmp_path):
    run = RunDirectory(tmp_path)
    document = run.write_result({"status": "complete", "resumed": False, "stages_reused": ["plan"]})
    again = run.reuse_result(document)
    assert (again["resumed"], again["stages_reused"]) == (True, ["plan", "semantic", "synthesis", "audio"])
    assert json.loads((tmp_path / "result.json").read_text(encoding="utf-8")) == again


@pytest.mark.parametrize("state,stage,after", [("decode_failed", "synthesis", "semantic_generated"),
                                               ("complete", "plan", "created"),
                                               ("planned", "semantic", "planned"),  # not claimed: no write
                                               ("cancelled", "audio", "cancelled")])
def test_a_redone_stage_is_no_longer_claimed(tmp_path, state, stage, after):
    run = _run_with(tmp_path, state)
    before = (run.path / "run_state.json").stat().st_mtime_ns
    run.stop_claiming(stage, "run", {})
    assert run.state()["state"] == after
    assert ((run.path / "run_state.json").stat().st_mtime_ns == before) is (state == after)


def test_a_resume_removes_what_a_killed_writer_left_and_a_landed_stage_is_fsynced(tmp_path, monkeypatch):
    import os

    run = RunDirectory(tmp_path / "run")
    run.start("run", {"id": "x"}, resume=False)
    (run.path / "semantic.npy.4242.tmp").write_bytes(b"half a file")  # a writer killed before its rename
    (run.path / "keep.txt").write_text("mine", encoding="utf-8")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.path.isdir(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    assert run.start("run", {"id": "x"}, resume=True)
    assert not list(run.path.glob("*.tmp")) and (run.path / "keep.txt").exists()
    synced.clear()
    run.write_stage("plan", "run", {"abc_tokens.npy": b"123"}, {})
    assert synced[-1] is True  # the directory itself, after the stage record landed
    assert sum(not d for d in synced) == 2  # the file and the record
