"""Room for songs' buffers: a song's NAR waits for room, visibly, and then completes; what never fits is refused."""
import threading
import time

import numpy as np
import pytest

from yue2_vllm.memory import vae_decode_bytes
from yue2_vllm.pipeline import YuE2Pipeline
from yue2_vllm.protocol import SongRequest
from yue2_vllm.room import DeviceRoom
from yue2_vllm.scheduler import SongScheduler
from yue2_vllm.options import AROptions, DeviceOptions

GENERATION = {"abc": {"max_tokens": 6, "min_tokens": 6}, "semantic": {"max_tokens": 12, "min_tokens": 12},
              "ode_steps": 2}
REQUEST = SongRequest("piano pop", "[verse]\nla la\n", seed=5, id="waits")


def test_the_ledger_admits_waits_and_refuses_by_the_figures():
    room = DeviceRoom(10 * 2**30)
    with room.admit(6 * 2**30, "vae tile"):
        assert room.free == 4 * 2**30 and not room.fits_now(5 * 2**30)
        assert room.describe()["holders"] == [("vae tile", 6 * 2**30)]
    assert room.free == room.capacity
    with pytest.raises(MemoryError, match=r"nar of 1 song needs 11.00 GiB on cuda, but the memory plan leaves "
                                          r"10.00 GiB .*--concurrency"):
        with room.admit(11 * 2**30, "nar of 1 song"):
            pass
    with room.admit(8 * 2**30, "vae tile"), pytest.raises(InterruptedError, match="waiting for room"):
        with room.admit(4 * 2**30, "nar of 1 song", cancelled=lambda: True):
            pass


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_vae_dir):
    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION)


def test_a_songs_nar_waits_for_room_in_its_status_and_then_completes(pipe, tmp_path, monkeypatch):
    # Reference latents with nothing to admit into (the CPU's rule).
    plan = pipe.plan(REQUEST)
    semantic = pipe.generate_semantic(plan)
    expected = pipe.synthesize(semantic)
    need = pipe.nar_need([semantic])
    tile = vae_decode_bytes(pipe.vae.config, pipe.options.device.vae_core_frames, 16)
    room = DeviceRoom(max(need, tile), "cpu")  # room for the NAR or a tile (the plan's song_room rule)
    held = room.capacity - need + 1  # another song's buffers: the NAR does not fit beside them
    events = []
    another_song = threading.Event()
    release = threading.Event()

    def other_songs_buffers():
        with room.admit(held, "vae tile of another song"):
            another_song.set()
            release.wait(30)

    def listener(event):
        events.append(event)
        if event.kind == "stage_done" and event.data["stage"] == "semantic":  # the AR phases ran unadmitted
            monkeypatch.setattr(pipe.engine_life, "room", room)  # the limited room figure; admission is the real code

    holder = threading.Thread(target=other_songs_buffers)
    holder.start()
    assert another_song.wait(10)
    with SongScheduler(pipe, concurrency=1, listener=listener) as scheduler:
        handle = scheduler.submit(REQUEST, tmp_path / "waits")
        deadline = time.monotonic() + 60
        while handle.waiting is None and time.monotonic() < deadline and not handle.done:
            time.sleep(0.05)
        waiting = handle.waiting
        assert not handle.done, (handle.state, handle.error)
        assert waiting is not None and handle.state == "synthesizing"
        assert (waiting["stage"], waiting["need_bytes"], waiting["free_bytes"]) == ("nar", need, need - 1)
        assert "nar" not in handle.progress  # no ODE step ran while it waited
        time.sleep(0.3)
        assert not handle.done and handle.waiting is not None
        release.set()
        holder.join(10)
        assert handle.wait(120) and handle.state == "complete", handle.error
    assert handle.waiting is None and room.used == 0 and len(room.waits) == 1
    kinds = [event.kind for event in events]
    assert "waiting" in kinds and kinds.index("waiting") < kinds.index("nar")
    (record,) = [e.data["meta"] for e in events if e.kind == "stage_done" and e.data["stage"] == "synthesis"]
    assert record["room_need_bytes"] == need and record["room_wait_seconds"] >= 0.3
    assert record["prefill_weights"] == "resident" and record["streamed_bytes"] == 0
    latents = np.load(tmp_path / "waits" / "latent.npy")
    assert np.array_equal(latents, expected)  # waiting changed nothing about the song


def test_a_budget_above_the_card_or_too_small_for_one_song_is_refused_before_anything_loads(
        fake_gpu, tiny_model_dir, tiny_vae_dir, monkeypatch):
    import yue2_vllm.song.models as models_module
    import yue2_vllm.song.resolved as resolved_module

    gpu = fake_gpu("L40S")
    loads = []
    monkeypatch.setattr(models_module, "load_model", lambda *a, **k: loads.append(a) or 1 / 0)
    monkeypatch.setattr(resolved_module, "vllm_usable", lambda: True)
    card = gpu["total"] / 2**30
    with pytest.raises(ValueError, match=rf"--budget 60.00 GiB is above this GPU's {card:.2f} GiB: lower --budget"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="vllm"),
                     device=DeviceOptions(device="cuda", budget_gib=60))
    with pytest.raises(MemoryError, match=r"need .* but the budget allows 3.00 GiB .*--concurrency.*FP8"):
        YuE2Pipeline(tiny_model_dir, tiny_vae_dir, ar=AROptions(backend="vllm"),
                     device=DeviceOptions(device="cuda", budget_gib=3))
    assert loads == []


def test_on_unified_memory_the_decoders_room_is_the_pool_not_mem_get_info(pipe, fake_gpu, tmp_path, monkeypatch):
    import torch
    from conftest import write_meminfo

    import yue2_vllm.memory as memory
    from yue2_vllm.memory import GIB, unified_pool

    gpu = fake_gpu("GB10")
    meminfo = write_meminfo(tmp_path / "meminfo", gpu["total"], 40 * GIB)
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    pool = unified_pool(meminfo)
    monkeypatch.setattr(pipe, "device", torch.device("cuda", 0))
    monkeypatch.setattr(pipe, "unified", pool)
    assert pipe._device_room() == pool.pool == 40 * GIB - pool.reserve != gpu["free"]
    room = DeviceRoom(3 * GIB)
    monkeypatch.setattr(pipe.engine_life, "room", room)  # beside the engine: the plan's room
    with room.admit(GIB, "vae tile"):
        assert pipe._device_room() == 2 * GIB


def watch_admissions(room: DeviceRoom, monkeypatch) -> list[tuple[str, int]]:
    """The (what, bytes) of each admission into `room` from now on, in order."""
    holders = []
    original = room.admit

    def watched(need_bytes, what, **kwargs):
        holders.append((what, need_bytes))
        return original(need_bytes, what, **kwargs)

    monkeypatch.setattr(room, "admit", watched)
    return holders


def test_a_torch_backend_phase_is_admitted_into_the_same_room(pipe, monkeypatch):
    from yue2_vllm.memory import torch_decode_bytes

    prompt = pipe.plan  # the abc phase runs on the torch backend here
    tiny = DeviceRoom(1, "cpu")
    monkeypatch.setattr(pipe.engine_life, "room", tiny)
    need = torch_decode_bytes(pipe.model.config, 1, 1)  # at least one row's K/V: far above a 1-byte room
    with pytest.raises(MemoryError, match=r"abc phase on the torch backend needs .* the memory plan leaves"):
        prompt(REQUEST)
    assert need > tiny.capacity and tiny.used == 0
    roomy = DeviceRoom(2**40, "cpu")
    monkeypatch.setattr(pipe.engine_life, "room", roomy)
    holders = watch_admissions(roomy, monkeypatch)
    plan = prompt(REQUEST)
    (what, admitted), = holders
    assert what == "abc phase on the torch backend" and roomy.used == 0 and plan.abc_ids
    from yue2_vllm.protocol import abc_prompt

    tokens = len(abc_prompt(REQUEST, pipe.tokenizer)) + pipe.sampling_for(None, "abc").max_tokens
    assert admitted == torch_decode_bytes(pipe.model.config, tokens, 1)  # the AR expert is resident on the CPU


def test_a_long_or_continued_songs_torch_phase_is_admitted_by_its_real_length(pipe, monkeypatch, tmp_path):
    """The semantic phase's K/V is sized by the song's own budget: a `seconds` cap past the configured max_tokens,
    and a continued song's longer cap over the parent's prompt (not the parent's cap, not only the new tokens)."""
    from dataclasses import replace

    from yue2_vllm.memory import torch_decode_bytes

    roomy = DeviceRoom(2**40, "cpu")
    monkeypatch.setattr(pipe.engine_life, "room", roomy)
    holders = watch_admissions(roomy, monkeypatch)
    capped = replace(REQUEST, seconds=0.48, id="capped")  # 12 tokens
    pipe.generate_to(tmp_path / "capped", capped)
    prefix = len(np.load(tmp_path / "capped" / "prefix.npy"))
    branches = 2 if capped.guidance != 1.0 else 1
    pipe.continue_song(tmp_path / "capped", tmp_path / "longer", 2)  # 50 tokens, past max_tokens 12
    semantic = [need for what, need in holders if what == "semantic phase on the torch backend"]
    assert semantic == [torch_decode_bytes(pipe.model.config, prefix + 12, branches),
                        torch_decode_bytes(pipe.model.config, prefix + 50, branches)]
    assert roomy.used == 0
