import pytest
import torch

from yue2_vllm.model.nar import (SongInput, offloaded_ar, raw_timestep, solve, song_chunks, song_noise, synthesize,
                           synthesize_many)
from yue2_vllm.protocol import CODEC_OFFSET, CODEC_SIZE, EOD, MUSIC_END, MUSIC_START

PREFIX = [EOD, 40, 1771, 285, 151847, 300, 151848, MUSIC_START]


def test_noise_is_one_cpu_draw_with_chunk_views():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    chunks = song_chunks(PREFIX, list(range(30)), seed=5, context=40)
    assert torch.equal(torch.get_rng_state(), before)
    size = (40 - len(PREFIX) - 3) // 2
    assert [len(c.noise) for c in chunks] == [size, size, 30 - 2 * size]
    whole = song_noise(30, 5)
    assert torch.equal(torch.cat([c.noise for c in chunks]), whole)
    assert chunks[1].noise.untyped_storage().data_ptr() == chunks[0].noise.untyped_storage().data_ptr()
    assert chunks[1].tokens == PREFIX + [CODEC_OFFSET + c for c in range(size, 2 * size)] + [MUSIC_END]
    assert whole.dtype == torch.float32 and whole.shape == (30, 64)


def test_invalid_inputs():
    with pytest.raises(ValueError, match=r"^semantic.tokens\[0\] = 32768 is not a codec index in \[0, 32768\)$"):
        song_chunks(PREFIX, [32768], 0)
    with pytest.raises(ValueError, match="at least one semantic token"):
        song_chunks(PREFIX, [], 0)


@pytest.mark.parametrize("prefix,codec,seed,message", [
    # the token protocol's checks and messages: never coerced with int()
    ([1.0, *PREFIX[1:]], [3], 0, "prefix[0] = 1.0 is not an integer id in [0, 184704)"),
    (PREFIX, [3, True], 0, "semantic.tokens[1] = True is not a codec index in [0, 32768)"),
    (PREFIX, [3.0], 0, "semantic.tokens[0] = 3.0 is not a codec index in [0, 32768)"),
    (PREFIX, [3], 2.5, "seed must be an integer in [0, 2**63), got 2.5"),
    (PREFIX, [3], True, "seed must be an integer in [0, 2**63), got True"),
    (PREFIX, [3], -1, "seed must be an integer in [0, 2**63), got -1"),
])
def test_the_nar_entry_refuses_what_the_protocol_refuses(prefix, codec, seed, message):
    with pytest.raises(ValueError) as info:
        song_chunks(prefix, codec, seed)
    assert str(info.value) == message
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        with pytest.raises(ValueError, match=r"^seed must be an integer"):
            song_noise(4, seed)


def test_numpy_integers_are_ids():
    import numpy as np

    chunks = song_chunks(np.asarray(PREFIX, np.int32), np.asarray([1, 2], np.int64), np.int64(5))
    assert chunks[0].tokens == PREFIX + [CODEC_OFFSET + 1, CODEC_OFFSET + 2, MUSIC_END]
    assert all(type(t) is int for t in chunks[0].tokens) and torch.equal(chunks[0].noise, song_noise(2, 5))


def test_timesteps():
    assert raw_timestep(1.0) == 20.0 and raw_timestep(0.0) == -20.0 and raw_timestep(0.5) == 0.0


def test_midpoint_solver_matches_hand_loop():
    calls = []

    def velocity(state, raw_t):
        calls.append(raw_t)
        return state * 0.5 + raw_t / 40

    noise = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    result = solve(velocity, noise, steps=32)
    assert len(calls) == 64 and calls[0] == 20.0
    state, dt = noise.to(torch.bfloat16), 1 / 32
    for k in range(32):
        t = 1 - k * dt
        first = state * 0.5 + raw_timestep(t) / 40
        mid = state - first * (dt / 2)
        state = state - (mid * 0.5 + raw_timestep(t - dt / 2) / 40) * dt
    assert result.dtype == torch.float32 and torch.equal(result, state.float())


def test_solver_progress_cancel_and_nonfinite():
    noise = torch.zeros(2, 64)
    steps = []
    solve(lambda s, t: s, noise, steps=4, on_step=lambda d, n: steps.append((d, n)))
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]
    count = []
    with pytest.raises(InterruptedError):
        solve(lambda s, t: count.append(1) or s, noise, steps=4, cancelled=lambda: len(count) >= 3)
    assert len(count) == 3
    with pytest.raises(FloatingPointError):
        solve(lambda s, t: s + float("inf"), noise, steps=1)


def test_synthesize_chunks_serially_and_repeatably(tiny_model):
    progress = []
    codec = list(range(0, 3000, 100))
    first = synthesize(tiny_model, PREFIX, codec, seed=9, steps=3, context=40,
                       on_progress=lambda d, n: progress.append((d, n)))
    assert first.shape == (30, 64) and first.dtype == torch.float32
    assert progress == [(i, 9) for i in range(1, 10)]  # 3 chunks x 3 steps
    assert torch.equal(first, synthesize(tiny_model, PREFIX, codec, seed=9, steps=3, context=40))
    assert not torch.equal(first, synthesize(tiny_model, PREFIX, codec, seed=10, steps=3, context=40))


def test_synthesize_cancellation(tiny_model):
    with pytest.raises(InterruptedError):
        synthesize(tiny_model, PREFIX, [1, 2, 3], seed=0, steps=4, cancelled=lambda: True)


def test_batched_songs_equal_their_single_synthesis(tiny_model):
    """Songs of different lengths and prefixes (one of them in three chunks) in one lockstep batch."""
    songs = [SongInput(PREFIX + [300 + i] * i, list(range(i * 7, i * 7 + 20 + 3 * i)), seed=i) for i in range(3)]
    songs.append(SongInput(PREFIX, list(range(0, 3000, 100)), seed=9))
    progress, chunked = [], []
    songs[1].on_progress = lambda done, total: progress.append((done, total))
    songs[3].on_progress = lambda done, total: chunked.append((done, total))
    batched = synthesize_many(tiny_model, songs, steps=3, context=40)
    single_totals = set()
    for song, latents in zip(songs, batched):
        single = synthesize(tiny_model, song.prefix, song.codec, song.seed, steps=3, context=40,
                            on_progress=lambda done, total: single_totals.add(total) if song is songs[3] else None)
        assert latents.shape == single.shape and torch.allclose(latents, single, rtol=2 ** -7, atol=2 ** -7)
    assert progress == [(2, 6), (4, 6), (6, 6)]  # two chunks
    assert chunked == [(3, 9), (6, 9), (9, 9)] and single_totals == {9}  # one total: 3 chunks x 3 steps


def test_batch_failures_and_cancellation_stay_with_their_song(tiny_model):
    calls = []
    songs = [SongInput(PREFIX, [1, 2, 3], seed=0),
             SongInput(PREFIX, [1, 2, 3], seed=1, cancelled=lambda: len(calls) >= 2,
                       on_progress=lambda d, n: calls.append(d)),
             SongInput(PREFIX, [CODEC_SIZE + 5], seed=2),  # not a codec index
             SongInput(PREFIX, [4, 5], seed=3)]
    results = synthesize_many(tiny_model, songs, steps=4)
    assert isinstance(results[1], InterruptedError) and isinstance(results[2], ValueError)
    assert torch.allclose(results[0], synthesize(tiny_model, PREFIX, [1, 2, 3], seed=0, steps=4), atol=2 ** -7)
    assert results[3].shape == (2, 64)


def test_offloaded_ar_is_a_no_op_on_the_cpu_and_restores_after_errors(tiny_model):
    before = {name: p.device for name, p in tiny_model.named_parameters()}
    with pytest.raises(RuntimeError):
        with offloaded_ar(tiny_model):
            raise RuntimeError("boom")
    assert {name: p.device for name, p in tiny_model.named_parameters()} == before
    assert torch.equal(synthesize(tiny_model, PREFIX, [1, 2], seed=0, steps=2, offload_ar=True),
                       synthesize(tiny_model, PREFIX, [1, 2], seed=0, steps=2))
