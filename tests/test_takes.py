"""Takes: the seed rule, the options' checks, the pick, and takes through the CLI and batch on the tiny model."""
import json
import sys

import numpy as np
import pytest

from yue2_vllm.cli import main

from test_cli import FAST, config_file, model_args  # noqa: F401 (config_file: a fixture)
from yue2_vllm.protocol import MAX_SEED, SongRequest
from yue2_vllm.takes import (TakeOptions, check_takes_for, pick_take, pop_take_options, take_directory, take_id,
                             take_request, take_seed)
from yue2_vllm.options import AROptions, EngineOptions


def test_the_seed_rule_is_one_pure_function_and_take_one_keeps_the_seed():
    assert [take_seed(831001, k) for k in (1, 2, 3, 8)] == [831001, 831002, 831003, 831008]
    assert take_seed(MAX_SEED - 1, 2) == 0  # wraps within [0, 2**63)
    with pytest.raises(ValueError, match="take must be"):
        take_seed(1, 0)
    request = SongRequest("pop", "la", seed=7, id="x")
    assert take_request(request, 1) == request
    assert (take_request(request, 3).seed, take_request(request, 3).id) == (9, "x.t3")
    assert len(take_id("a" * 180, 8)) <= 180
    assert take_directory("/j", 1).as_posix() == "/j" and take_directory("/j", 4).as_posix() == "/j/takes/4"


@pytest.mark.parametrize("data, message", [
    ({"takes": 0}, r"^takes: must be an integer in \[1, 8\]"),
    ({"takes": 9}, r"^takes: must be an integer in \[1, 8\]"),
    ({"takes": 2.5}, r"^takes: "),
    ({"takes": True}, r"^takes: "),
    ({"best_of": True}, r"^best_of: needs takes >= 2"),
    ({"takes": 3, "best_of": 3}, r"^best_of: must be true or false"),
    ({"takes": 2, "takes_share_score": "yes"}, r"^takes_share_score: "),
    ({"takes_share_score": True}, r"^takes_share_score: needs takes >= 2"),
])
def test_bad_take_fields_name_the_field(data, message):
    with pytest.raises(ValueError, match=message):
        pop_take_options(dict(data))


def test_take_fields_leave_the_request_fields():
    data = {"style": "pop", "takes": 4.0, "best_of": True, "takes_share_score": True}
    assert pop_take_options(data) == TakeOptions(4, True, True) and data == {"style": "pop"}
    assert pop_take_options({"takes": 3}, limit=4).takes == 3
    with pytest.raises(ValueError, match=r"takes: must be an integer in \[1, 2\]"):
        pop_take_options({"takes": 3}, limit=2)


def test_a_plan_job_with_nothing_to_plan_refuses_takes():
    external = SongRequest("pop", "la", cot="melody", abc="X:1\nCDE|")
    with pytest.raises(ValueError, match="^takes: .*external score"):
        check_takes_for(external, TakeOptions(2), "plan")
    check_takes_for(external, TakeOptions(2), "audio")  # takes of one score
    check_takes_for(SongRequest("pop", "la"), TakeOptions(2), "plan")  # each take plans its own score


def test_the_pick_is_the_highest_score_else_the_highest_semantic_log_prob():
    records = [{"take": 1, "status": "complete", "signals": {"semantic_mean_logprob": -3.0}},
               {"take": 2, "status": "complete", "signals": {"semantic_mean_logprob": -1.0}},
               {"take": 3, "status": "failed", "signals": {}},
               {"take": 4, "status": "complete", "signals": {"semantic_mean_logprob": -1.0}}]
    assert pick_take(records) == 2  # ties: the lower take
    records[0]["score"] = 5.0
    assert pick_take(records) == 1  # a scorer ran: only scores count (takes 2 and 4 have none)
    assert pick_take([records[2]]) is None


def test_a_scorer_that_fails_on_a_take_leaves_it_unscored_with_the_reason(tmp_path):
    from yue2_vllm.takes import apply_scorer, command_scorer

    records = [{"take": k, "status": "complete", "directory": str(tmp_path / str(k)), "signals": {}} for k in (1, 2)]

    def scorer(record):
        if record["take"] == 2:
            raise RuntimeError("no audio")
        return 0.5

    apply_scorer(records, scorer)
    assert records[0]["score"] == 0.5 and records[1]["score"] is None and "no audio" in records[1]["score_error"]
    assert pick_take(records) == 1
    (tmp_path / "bad.py").write_text("print('no number')")
    with pytest.raises(RuntimeError, match="printed no number for take 1"):
        command_scorer(f"{sys.executable} {tmp_path / 'bad.py'}")(records[0])
    with pytest.raises(ValueError, match="empty command"):
        command_scorer("  ")


def lines(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


SCORER = """import sys, numpy as np
tokens = np.load(sys.argv[1] + "/semantic.npy")
print(-float(tokens[0]))
"""


def test_generate_takes_are_the_one_take_songs_of_their_seeds(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                              capsys):
    models = model_args(tiny_model_dir, tiny_vae_dir, config_file)
    song = ["--style", "pop", "--lyrics", "[verse]\nla", "--seed", "40", "--id", "s"]
    (tmp_path / "score.py").write_text(SCORER)
    scorer = f"{sys.executable} {tmp_path / 'score.py'}"
    assert main(["generate", *models, *FAST, *song, "--takes", "3", "--best-of", "--scorer", scorer,
                 "--output", str(tmp_path / "takes")]) == 0
    statuses = lines(capsys)
    assert [s.get("take") for s in statuses[:3]] == [1, 2, 3] and statuses[-1]["status"] == "takes"
    assert [s["seed"] for s in statuses[:3]] == [40, 41, 42] and statuses[-1]["complete"] == [1, 2, 3]
    root = tmp_path / "takes" / "s"
    listing = json.loads((root / "takes.json").read_text())
    for k, record in enumerate(listing["results"], 1):
        assert record["status"] == "complete" and record["seed"] == 39 + k
        assert record["signals"]["semantic_mean_logprob"] < 0 and record["signals"]["abc_mean_logprob"] < 0
        assert record["signals"]["semantic_cached_prompt_tokens"] is None  # the torch backend has no cache
    # the scorer's number decides the pick (the lowest first semantic token here)
    firsts = {k: int(np.load(take_directory(root, k) / "semantic.npy")[0]) for k in (1, 2, 3)}
    assert listing["pick"] == min(firsts, key=lambda k: (firsts[k], k))
    assert listing["signal"].startswith("scorer: ") and all("score" in r for r in listing["results"])
    # each take is exactly the one-take song of its seed (take 1 also in the one-take directory)
    for k in (1, 2, 3):
        assert main(["generate", *models, *FAST, *song[:4], "--seed", str(39 + k), "--id", f"one{k}",
                     "--output", str(tmp_path / "one")]) == 0
        one, take = tmp_path / "one" / f"one{k}", take_directory(root, k)
        for name in ("abc_tokens.npy", "semantic.npy"):
            assert np.array_equal(np.load(one / name), np.load(take / name)), (k, name)
    capsys.readouterr()
    # --resume finds every take finished and redoes nothing
    assert main(["generate", *models, *FAST, *song, "--takes", "3", "--resume", "--output", str(tmp_path / "takes")]) == 0
    assert all(s["resumed"] for s in lines(capsys)[:3])


def test_generate_takes_share_one_score_and_bad_flags_are_named(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                               capsys):
    models = model_args(tiny_model_dir, tiny_vae_dir, config_file)
    song = ["--style", "pop", "--lyrics", "[verse]\nla", "--seed", "3", "--id", "s"]
    assert main(["generate", *models, *FAST, *song, "--takes", "2", "--takes-share-score",
                 "--output", str(tmp_path / "o")]) == 0
    root = tmp_path / "o" / "s"
    assert (root / "score.abc").read_text() == (take_directory(root, 2) / "score.abc").read_text()
    capsys.readouterr()
    assert main(["generate", *models, *FAST, *song, "--best-of", "--output", str(tmp_path / "p")]) == 2
    assert "--best-of" in capsys.readouterr().err
    assert main(["generate", *models, *FAST, *song, "--cot", "off", "--takes", "2", "--stage", "plan",
                 "--output", str(tmp_path / "p")]) == 2
    assert "--takes" in capsys.readouterr().err and not (tmp_path / "p").exists()


def test_batch_rows_with_takes(tiny_model_dir, tiny_vae_dir, config_file, tmp_path, capsys):
    rows = [{"id": "a", "style": "pop", "lyrics": "la", "seed": 5, "takes": 2, "best_of": True},
            {"id": "b", "style": "pop", "lyrics": "la", "seed": 6},
            {"id": "c", "style": "pop", "lyrics": "la", "takes": 9}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    code = main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")])
    assert code == 1  # row c
    summary = json.loads((tmp_path / "out" / "batch.json").read_text())
    a, b, c = summary["results"]
    assert a["status"] == "complete" and a["complete"] == [1, 2] and a["pick"] in (1, 2)
    assert [r["seed"] for r in a["results"]] == [5, 6]
    assert b["status"] == "complete" and c["status"] == "failed" and "takes: must be an integer in [1, 8]" in c["reason"]
    # take 2 of row a (seed 6) is row b's song
    assert np.array_equal(np.load(tmp_path / "out" / "a" / "takes" / "2" / "semantic.npy"),
                          np.load(tmp_path / "out" / "b" / "semantic.npy"))


# --------------------------------------------------------------------------- on a real vLLM-CPU engine

from yue2_vllm.engine.backend import vllm_version  # noqa: E402

needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
ENGINE_GENERATION = {"abc": {"max_tokens": 8, "min_tokens": 8}, "semantic": {"max_tokens": 24, "min_tokens": 24},
                     "ode_steps": 2}


@pytest.fixture(scope="module")
def reproducible_pipe(tiny_model_dir, tiny_vae_dir):
    from yue2_vllm.pipeline import YuE2Pipeline

    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=ENGINE_GENERATION,
                        ar=AROptions(backend="vllm", reproducible=True),
                        engine=EngineOptions(max_num_seqs=8, max_num_batched_tokens=256))
    yield pipe
    pipe.close()


@pytest.mark.slow
@needs_vllm
def test_under_reproducible_take_k_is_the_one_take_song_of_its_seed_and_shares_the_prompt(reproducible_pipe,
                                                                                         tmp_path):
    from yue2_vllm.scheduler import SongScheduler, generate_many
    from yue2_vllm.takes import run_takes

    lyrics = "[verse]\n" + "city lights are fading slow, I keep the words you said\n" * 4
    request = SongRequest("pop, piano, warm female vocal", lyrics, seed=60, id="t")
    with SongScheduler(reproducible_pipe, concurrency=4) as scheduler:
        document = run_takes(scheduler, request, tmp_path / "takes", TakeOptions(4, best_of=True))
    assert document["complete"] == [1, 2, 3, 4] and document["pick"] in (1, 2, 3, 4)
    ones = [SongRequest(request.style, lyrics, seed=60 + k - 1, id=f"one{k}") for k in (1, 2, 3, 4)]
    alone = {h.id: h for h in generate_many(reproducible_pipe, ones, tmp_path / "one", concurrency=1)}
    assert {h.state for h in alone.values()} == {"complete"}
    for k, record in enumerate(document["results"], 1):
        take, one = take_directory(tmp_path / "takes", k), tmp_path / "one" / f"one{k}"
        for name in ("abc_tokens.npy", "semantic.npy"):  # exactly the tokens of the one-take song of its seed
            assert np.array_equal(np.load(take / name), np.load(one / name)), (k, name)
        timing = json.loads((take / "result.json").read_text())["timing"]
        alone_timing = json.loads((one / "result.json").read_text())["timing"]
        for phase in ("abc", "semantic"):
            signals = timing[phase]
            assert signals["backend_actual"] == "vllm" and signals["logprob_tokens"] == signals["output_tokens"]
            assert signals["mean_logprob"] < 0
            assert abs(signals["mean_logprob"] - alone_timing[phase]["mean_logprob"]) < 1e-4  # the model's own
        assert record["signals"]["semantic_mean_logprob"] == timing["semantic"]["mean_logprob"]
        if k > 1:  # the score prompt is the same for every take: prefilled once, from the cache for the others
            cached, prompt = timing["abc"]["cached_prompt_tokens"], timing["abc"]["prompt_tokens"]
            assert cached >= 0.9 * prompt - 16, (k, cached, prompt)  # whole 16-token blocks
    print({k: json.loads((take_directory(tmp_path / "takes", k) / "result.json").read_text())["timing"]["abc"]
           ["cached_prompt_tokens"] for k in (1, 2, 3, 4)})


@pytest.mark.slow
@needs_vllm
def test_cfg_pair_takes_record_the_cond_rows_log_probs_and_cache_hits(reproducible_pipe, tmp_path):
    from yue2_vllm.scheduler import generate_takes

    request = SongRequest("pop, piano", "[verse]\nla la la, la la la\n", cot="off", seed=5, id="p")
    document = generate_takes(reproducible_pipe, request, tmp_path / "p", TakeOptions(2))
    assert document["complete"] == [1, 2]
    for k in (1, 2):
        semantic = json.loads((take_directory(tmp_path / "p", k) / "result.json").read_text())["timing"]["semantic"]
        assert semantic["cfg_branches"] == 2 and semantic["logprob_tokens"] == semantic["output_tokens"]
        assert semantic["mean_logprob"] < 0 and semantic["cached_prompt_tokens"] is not None
