"""Heard notes onto the grid: the tempo found from onsets (one octave searched, plain rhythms preferred), a tempo that
moves followed, the downbeat, note lengths and rests, and the drift one Q: makes (figures checked against the
arithmetic of the synthetic onsets)."""
import math

import pytest

from yue2_vllm.transcription.tempo import (Grid, beat_drift, drift, drift_warning, note_lengths, pickup_phase,
                                           quantize, search_tempo, step_of, track)

# A melody in quarter-note positions: quarters, eighths, a half, a dotted quarter (onsets only matter here).
RHYTHM = [0, 1, 2, 2.5, 3, 4, 6, 7, 8, 8.5, 9, 9.5, 10, 12, 13.5, 14, 16, 17, 18, 19, 20, 22, 24]
JITTER = [0.012, -0.009, 0.004, -0.014, 0.010, -0.003, 0.013, -0.011, 0.006, -0.007, 0.001, 0.014]  # seconds


def onsets_at(quarters, bpm, start=0.4, jitter=True):
    return [start + q * 60 / bpm + (JITTER[i % len(JITTER)] if jitter else 0.0) for i, q in enumerate(quarters)]


def steps(quarters, first=0):
    return [round((q - quarters[0]) * 4) + first for q in quarters]


@pytest.mark.parametrize("bpm", [72, 100, 128, 139])
def test_the_tempo_is_found_from_jittered_onsets_and_every_note_lands_on_its_step(bpm):
    onsets = onsets_at(RHYTHM, bpm)
    offsets = [onset + 0.2 for onset in onsets]
    grid = quantize(onsets, offsets, (4, 4))
    assert grid.written_bpm == bpm and abs(grid.fitted_bpm - bpm) < 0.3
    assert list(grid.positions) == steps(RHYTHM)


def test_exact_onsets_give_the_exact_tempo():
    onsets = onsets_at(RHYTHM, 100, jitter=False)
    assert 60 / (search_tempo(onsets, [0.3] * len(onsets), (4, 4)) * 4) == pytest.approx(100, abs=1e-9)


@pytest.mark.parametrize("quarters, bpm, expected", [
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 100, 100),  # quarters: not 75 (dotted eighths) nor 125 (fives)
    ([0, 2, 4, 6, 8, 10, 12, 14], 80, 80),  # half notes: not 120 (dotted halves)
    ([0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7], 130, 130),
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 160, 80),  # above the searched octave: written at half, in eighths
])
def test_one_octave_is_searched_and_the_plainest_rhythm_wins(quarters, bpm, expected):
    onsets = onsets_at(quarters, bpm)
    assert quantize(onsets, [t + 0.1 for t in onsets], (4, 4)).written_bpm == expected


def test_a_compound_meter_searches_its_eighths_three_to_a_beat():
    quarters = [0, 1.5, 3, 3.5, 4, 4.5, 6, 7.5, 9]  # 6/8: dotted quarters and eighths at 180 eighths a minute
    onsets = onsets_at(quarters, 90)
    grid = quantize(onsets, [t + 0.1 for t in onsets], (6, 8))
    assert grid.written_bpm == 90 and list(grid.positions) == [round(q * 8) for q in quarters]


@pytest.mark.parametrize("meter, searched, written", [
    ((4, 16), (140.0, 280.0), 50),  # sixteenths: 35-70 quarters a minute (an octave up from 17.5-35)
    ((7, 16), (140.0, 280.0), 50),
    ((2, 2), (70.0, 140.0), 200),  # halves: 140-280 quarters, inside already
    ((4, 4), (70.0, 140.0), 100),
    ((6, 8), (140.0, 280.0), 100),
])
def test_the_searched_octave_lies_inside_the_tempi_a_request_may_give(meter, searched, written):
    from yue2_vllm.transcription.request import BPM_RANGE
    from yue2_vllm.transcription.tempo import beat_range

    low, high = beat_range(meter)
    assert (low, high) == searched and BPM_RANGE[0] <= low * 4 / meter[1] < high * 4 / meter[1] <= BPM_RANGE[1]
    onsets = onsets_at(RHYTHM, 100)  # a melody at 100 quarters a minute, read in each meter's beats
    grid = quantize(onsets, [t + 0.2 for t in onsets], meter)
    assert grid.written_bpm == written and BPM_RANGE[0] <= grid.written_bpm <= BPM_RANGE[1]
    # a step is 1/(4d) of a whole note: at Q:1/4=50 the melody's quarters are eighths, 8 sixty-fourths each
    doubled = meter in ((6, 8), (4, 16), (7, 16))
    assert list(grid.positions)[:6] == ([0, 8, 16, 20, 24, 32] if doubled else [0, 4, 8, 10, 12, 16])


def test_the_written_tempo_is_rounded_inside_the_tempi_a_request_may_give():
    from yue2_vllm.transcription.tempo import written_tempo

    assert [written_tempo(bpm) for bpm in (29.4, 30.5, 99.5, 100.5, 299.6, 412.0)] == [30, 30, 100, 100, 300, 300]


def test_a_given_tempo_is_written_and_the_grid_follows_it():
    onsets = onsets_at([0, 1, 2, 3, 4, 5], 100)
    grid = quantize(onsets, [t + 0.3 for t in onsets], (4, 4), bpm=50)
    assert grid.written_bpm == 50 and list(grid.positions) == [0, 2, 4, 6, 8, 10]


def moving(quarters, start_bpm, end_bpm, start=0.4):
    """Onsets under a tempo moving linearly (in quarters) from start_bpm to end_bpm over the last note's quarter:
    t(q) = start + 60 * ln(1 + k q / a) / k for bpm(q) = a + k q."""
    a, k = start_bpm, (end_bpm - start_bpm) / quarters[-1]
    return [start + (60 * math.log1p(k * q / a) / k if k else 60 * q / a) for q in quarters]


def test_a_tempo_that_moves_is_followed_and_the_drift_of_one_q_is_foretold():
    quarters = [q + 16 * bar for bar in range(8) for q in (0, 1, 2, 3, 4, 6, 7, 8, 8.5, 9, 10, 12, 14)]
    onsets = moving(quarters, 90, 120)
    grid = quantize(onsets, [t + 0.15 for t in onsets], (4, 4))
    assert list(grid.positions) == steps(quarters)
    report = drift(grid, onsets)
    step = 60 / (grid.written_bpm * 4)
    offsets = [(t - onsets[0] - p * step) / (4 * step) for t, p in zip(onsets, grid.positions)]
    largest = max(range(len(offsets)), key=lambda i: abs(offsets[i]))
    assert report.written_bpm == grid.written_bpm and report.end_offset_beats == pytest.approx(offsets[-1])
    assert report.max_offset_beats == pytest.approx(offsets[largest])
    assert report.max_offset_second == onsets[largest] and abs(report.max_offset_beats) > 1
    assert report.first_beat_off_second == next(t for t, o in zip(onsets, offsets) if abs(o) > 1)
    assert report.local_bpm[0] < 95 and report.local_bpm[1] > 115
    warning = drift_warning(report)
    assert warning.code == "drift" and warning.figures == report.record()
    assert f"from {report.first_beat_off_second:.1f} s a note is more than a beat off" in warning.message
    assert f"one Q:1/4={report.written_bpm} cannot follow it" in warning.message


def test_a_steady_tempo_foretells_no_drift():
    onsets = onsets_at(RHYTHM * 1, 100)
    report = drift(quantize(onsets, [t + 0.2 for t in onsets], (4, 4)), onsets)
    assert report.first_beat_off_second is None and drift_warning(report) is None
    assert abs(report.max_offset_beats) < 0.1


def test_the_downbeat_is_where_the_rhythm_is_plainest_or_where_it_is_given():
    # A one-beat pickup: the first note on beat four, long notes on the downbeats after it.
    quarters = [0, 1, 3, 3.5, 5, 7, 7.5, 9]
    onsets = onsets_at(quarters, 96)
    positions, _ = track(onsets, step_of(96, (4, 4)), (4, 4))
    durations = [0.5, 1.2, 0.3, 0.3, 1.2, 0.3, 0.3, 2.0]
    assert pickup_phase(positions, durations, (4, 4)) == 12
    grid = quantize(onsets, [t + d for t, d in zip(onsets, durations)], (4, 4), pickup_beats=2)
    assert grid.positions[0] == 8  # two beats before the first downbeat
    grid = quantize(onsets, [t + d for t, d in zip(onsets, durations)], (4, 4), pickup_beats=0)
    assert grid.positions[0] == 0


def test_note_lengths_fill_to_the_next_note_or_leave_a_rest_and_snap_to_a_near_beat():
    step = 0.15
    positions = [0, 4, 12, 16]
    onsets = [p * step for p in positions]
    # 0: sounds 3.4 steps, 0.6 of silence: to the next note (4). 1: sounds 3.4 steps, 4.6 of silence: a rest
    # after 4 (3.4 + 0.25 rounds to 4). 2: sounds 2.2 steps then 1.8 of silence: 2 steps and a rest. 3: the last,
    # sounds 7.3 steps: 8 (rounds to 8).
    offsets = [onsets[0] + 3.4 * step, onsets[1] + 3.4 * step, onsets[2] + 2.2 * step, onsets[3] + 7.3 * step]
    assert note_lengths(positions, onsets, offsets, [step] * 4) == [4, 4, 2, 8]
    # The last note sounds 6.8 steps: 7 rounds one step short of the beat, so it is taken to the beat.
    assert note_lengths([0], [0.0], [6.8 * step], [step]) == [8]


def test_the_drift_of_decoded_beats():
    steady = [0.5 + 0.625 * i for i in range(40)]
    report = beat_drift(steady, (4, 4), 96)
    assert report.fitted_bpm == pytest.approx(96) and report.first_beat_off_second is None
    assert report.local_bpm == pytest.approx((96, 96))
    slowing = [0.5 + sum(0.6 + 0.002 * j for j in range(i)) for i in range(60)]
    report = beat_drift(slowing, (4, 4), 90)
    beat = 60 / 90
    offsets = [(t - slowing[0] - i * beat) / beat for i, t in enumerate(slowing)]
    assert report.end_offset_beats == pytest.approx(offsets[-1]) and report.end_second == slowing[-1]
    assert report.first_beat_off_second == next(t for t, o in zip(slowing, offsets) if abs(o) > 1)
    assert "a beat is more than a beat off" in drift_warning(report, "beat").message
    assert beat_drift([1.0], (4, 4), 90) is None


def test_a_grid_knows_its_bar():
    assert Grid((0,), (4,), (0.15,), (3, 4), 100, 100.0).bar_steps == 12
