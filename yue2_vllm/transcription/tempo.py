"""Heard notes onto upstream's grid: the tempo, the downbeat, each note's place and length, and the drift one `Q:`
makes of a source whose tempo moves.

The grid is SheetSage2's: four steps to the meter's beat (L:1/16 in 4/4, L:1/32 in 6/8). Without a given tempo, the
first notes choose it: every tempo in one octave (`beat_range`; a tempo and its double never both compete) is
scored by how far the onsets sit from its grid and how plain a rhythm they make there (on downbeats, beats, eighths
or sixteenths, longer notes weighing more), and the best is fitted by least squares. The grid then follows the
source: each onset takes the nearest step of the tempo the last two bars' notes fit, so notes keep their musical
places where a singer speeds up or slows down. The score's one `Q:` is the least-squares tempo over all notes (or
the given one), and `drift` says where that single tempo leaves the source more than a beat behind or ahead.
"""
from __future__ import annotations

from dataclasses import dataclass

from .request import BPM_RANGE
from .result import TempoReport

STEPS_PER_BEAT = 4
TEMPO_OCTAVE = (70.0, 140.0)  # beats a minute searched (x/4: quarters; a compound x/8: its eighths, at twice this)
TEMPO_STEP = 0.25  # beats a minute between searched tempi (the best is then fitted exactly)
SEARCH_NOTES, SEARCH_SECONDS = 24, 12.0  # the first notes (at most) that choose the tempo
WINDOW_BARS = 2  # the stretch whose notes set the local tempo
RHYTHM_WEIGHT = 0.2  # how much a plain rhythm counts against the onsets' distance from the grid (in steps)
PICKUP_COST = 0.05  # what starting off the downbeat costs (a first note on beat one wins a tie)
REST_STEPS = 1.5  # a silence at least this long (in steps) before the next note is written as a rest
DRIFT_BEATS = 1.0  # warn where one Q: puts a note more than this far from the source


@dataclass(frozen=True)
class Grid:
    """The notes on the grid: `positions` and `lengths` in steps from the start of bar one (a pickup's rest
    included), `step_seconds` each note's local step, the written and fitted tempo."""

    positions: tuple[int, ...]
    lengths: tuple[int, ...]
    step_seconds: tuple[float, ...]
    meter: tuple[int, int]
    written_bpm: int
    fitted_bpm: float

    @property
    def bar_steps(self) -> int:
        return self.meter[0] * STEPS_PER_BEAT


def compound(meter: tuple[int, int]) -> bool:
    return meter[1] == 8 and meter[0] % 3 == 0 and meter[0] > 3


def beat_range(meter: tuple[int, int]) -> tuple[float, float]:
    """The searched tempi in the meter's beats a minute (a compound meter's eighths run three to its felt beat),
    moved by whole octaves until their quarter notes a minute lie inside BPM_RANGE, the tempi a request may give
    (x/16: 140-280 sixteenths, 35-70 quarters, not 17.5-35)."""
    low, high = (value * 2 for value in TEMPO_OCTAVE) if compound(meter) else TEMPO_OCTAVE
    quarters = 4 / meter[1]  # quarter notes in one of the meter's beats
    while low * quarters < BPM_RANGE[0]:
        low, high = low * 2, high * 2
    while high * quarters > BPM_RANGE[1]:
        low, high = low / 2, high / 2
    return low, high


def written_tempo(fitted_bpm: float) -> int:
    """The score's Q:1/4 for a fitted tempo: rounded, and inside BPM_RANGE (a tempo that moved past it is written at
    its edge; the drift says what that makes of the source)."""
    return min(max(int(round(fitted_bpm)), int(BPM_RANGE[0])), int(BPM_RANGE[1]))


def quarter_bpm(step_seconds: float, meter: tuple[int, int]) -> float:
    """Quarter notes a minute of a grid step (a step is 1/(4·d) of a whole note: 1/d of a quarter)."""
    return 60.0 / (step_seconds * meter[1])


def step_of(bpm: float, meter: tuple[int, int]) -> float:
    return 60.0 / (bpm * meter[1])


def _levels(meter: tuple[int, int]):
    """How plain a place in the bar is, per step: 0 on the downbeat, 0.25 on a beat, 0.6 on an eighth, 1 between."""
    import numpy as np

    steps = np.arange(meter[0] * STEPS_PER_BEAT)
    return np.where(steps == 0, 0.0, np.where(steps % 4 == 0, 0.25, np.where(steps % 2 == 0, 0.6, 1.0)))


def _plainness(positions, weights, levels):
    """Per bar phase (the first note's step in its bar), how plain the rhythm is: the weighted mean level."""
    import numpy as np

    phases = np.arange(len(levels))
    places = (positions[None, :] + phases[:, None]) % len(levels)
    return (levels[places] * weights[None, :]).sum(axis=1) / weights.sum()


def _line_fit(positions, times) -> tuple[float, float]:
    """Least squares time = intercept + slope · position: (slope, intercept)."""
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(positions, float), np.asarray(times, float), 1)
    return float(slope), float(intercept)


def search_tempo(onsets, durations, meter: tuple[int, int]) -> float:
    """The step (seconds) that best explains the first notes' onsets (at least 2)."""
    import numpy as np

    onsets = np.asarray(onsets, float)
    count = max(2, min(SEARCH_NOTES, int(np.searchsorted(onsets, onsets[0] + SEARCH_SECONDS, side="right"))))
    times, weights = onsets[:count] - onsets[0], np.asarray(durations[:count], float) + 0.1
    levels = _levels(meter)
    low, high = beat_range(meter)
    best = None
    for beats in np.arange(low, high, TEMPO_STEP):
        step = 60.0 / beats / STEPS_PER_BEAT
        x = times / step
        phase = np.angle(np.exp(2j * np.pi * x).mean()) / (2 * np.pi)
        positions = np.rint(x - phase).astype(int)
        positions -= positions[0]
        distance = float(np.sqrt(np.mean((x - phase - np.rint(x - phase)) ** 2)))
        score = distance + RHYTHM_WEIGHT * float(_plainness(positions, weights, levels).min())
        if best is None or score < best[0] - 1e-12:
            best = (score, step, positions)
    _, step, positions = best
    if positions[-1] > positions[0]:
        step = _line_fit(positions, times)[0]
    return step


def track(onsets, step: float, meter: tuple[int, int]) -> tuple[list[int], list[float]]:
    """Each onset's step (from the first note's, strictly rising) and the local step (seconds) there: the nearest
    step of the line the last WINDOW_BARS bars' notes fit (all the notes so far while those span less than a bar;
    the starting tempo through the first note until they span a beat)."""
    import numpy as np

    window = WINDOW_BARS * meter[0] * STEPS_PER_BEAT
    positions, steps = [0], [step]
    slope, intercept = step, float(onsets[0])
    for onset in onsets[1:]:
        position = max(positions[-1] + 1, int(np.rint((onset - intercept) / slope)))
        positions.append(position)
        first = next(i for i, p in enumerate(positions) if p >= position - window)
        if position - positions[first] < window // 2:
            first = 0
        if position - positions[first] >= STEPS_PER_BEAT:
            fitted, fitted_intercept = _line_fit(positions[first:], onsets[first:len(positions)])
            if 0.75 * step <= fitted <= 1.33 * step:  # a wild fit (a misheard note) keeps the tempo it had
                slope, intercept = fitted, fitted_intercept
        steps.append(slope)
    return positions, steps


def pickup_phase(positions, weights, meter: tuple[int, int]) -> int:
    """The first note's step in its bar that makes the plainest rhythm (the downbeat wins a tie)."""
    import numpy as np

    plain = _plainness(np.asarray(positions), np.asarray(weights, float) + 0.1, _levels(meter))
    plain[1:] += PICKUP_COST
    return int(np.argmin(plain))


def note_lengths(positions, onsets, offsets, steps) -> list[int]:
    """Each note's length in steps: up to the next note, unless a silence of REST_STEPS or more follows it; then
    (and for the last note) its sounding length rounded, and on to the next beat where that is near (a step away,
    or a sixth of the note: a sung note stops short of its value)."""
    lengths = []
    for index, (position, onset, offset, step) in enumerate(zip(positions, onsets, offsets, steps)):
        room = positions[index + 1] - position if index + 1 < len(positions) else None
        if room is not None and (onsets[index + 1] - offset) / step < REST_STEPS:
            lengths.append(room)
            continue
        length = max(1, int(round((offset - onset) / step)))
        to_beat = -(position + length) % STEPS_PER_BEAT
        if length >= 3 and 0 < to_beat <= max(1, length // 6):
            length += to_beat
        lengths.append(length if room is None else min(room, length))
    return lengths


def quantize(onsets, offsets, meter: tuple[int, int], bpm: float | None = None,
             pickup_beats: float | None = None) -> Grid:
    """The notes (onsets and offsets in seconds, rising) on the grid."""
    import numpy as np

    durations = [b - a for a, b in zip(onsets, offsets)]
    start = step_of(bpm, meter) if bpm is not None else search_tempo(onsets, durations, meter)
    positions, steps = track(list(onsets), start, meter)
    bar = meter[0] * STEPS_PER_BEAT
    lead = (bar - round(pickup_beats * STEPS_PER_BEAT)) % bar if pickup_beats is not None \
        else pickup_phase(positions, durations, meter)
    fitted = quarter_bpm(_line_fit(positions, onsets)[0], meter) if positions[-1] > 0 else quarter_bpm(start, meter)
    written = int(np.rint(bpm)) if bpm is not None else written_tempo(fitted)
    placed = [position + lead for position in positions]
    return Grid(tuple(placed), tuple(note_lengths(placed, onsets, offsets, steps)), tuple(steps), meter, written,
                fitted)


def offset_report(onsets, positions, meter: tuple[int, int], written_bpm: int, fitted_bpm: float,
                  local_bpm: tuple[float, float]) -> TempoReport:
    """What one Q:1/4=`written_bpm` makes of events the source sounds at `onsets` (seconds) and the score writes at
    `positions` (grid steps): each one's offset from where the score puts it, aligned on the first, in beats."""
    step = step_of(written_bpm, meter)
    beat = step * STEPS_PER_BEAT
    offsets = [(onset - onsets[0] - (position - positions[0]) * step) / beat
               for onset, position in zip(onsets, positions)]
    largest = max(range(len(offsets)), key=lambda index: abs(offsets[index]))
    first_off = next((onset for onset, offset in zip(onsets, offsets) if abs(offset) > DRIFT_BEATS), None)
    return TempoReport(fitted_bpm, written_bpm, local_bpm, offsets[largest], offsets[largest] * beat,
                       float(onsets[largest]), offsets[-1], offsets[-1] * beat, float(onsets[-1]),
                       None if first_off is None else float(first_off))


def drift(grid: Grid, onsets) -> TempoReport:
    """The notes' offsets under the score's one Q:, and the slowest and fastest local tempo the grid followed."""
    local = [quarter_bpm(value, grid.meter) for value in grid.step_seconds]
    return offset_report(onsets, grid.positions, grid.meter, grid.written_bpm, grid.fitted_bpm,
                         (min(local), max(local)))


def beat_drift(beats, meter: tuple[int, int], written_bpm: int) -> TempoReport | None:
    """The same for a source's decoded beats (seconds, one a meter's beat): the local tempo over two-bar windows;
    None for fewer than two beats."""
    if len(beats) < 2:
        return None
    positions = [index * STEPS_PER_BEAT for index in range(len(beats))]
    span = min(WINDOW_BARS * meter[0], len(beats) - 1)  # beats in a two-bar window
    local = [quarter_bpm((beats[index + span] - beats[index]) / span / STEPS_PER_BEAT, meter)
             for index in range(len(beats) - span)]
    fitted = quarter_bpm(_line_fit(positions, beats)[0], meter)
    return offset_report(beats, positions, meter, written_bpm, fitted, (min(local), max(local)))


def drift_warning(report: TempoReport, events: str = "note"):
    """The warning a face shows where one Q: leaves the source more than a beat off, with its figures; else None."""
    from .result import TranscriptionWarning

    if report.first_beat_off_second is None:
        return None
    where = "later" if report.max_offset_beats > 0 else "earlier"
    low, high = report.local_bpm
    message = (f"drift: the source's tempo moves ({low:.1f} to {high:.1f} bpm over two-bar stretches, "
               f"{report.fitted_bpm:.1f} on average) and one Q:1/4={report.written_bpm} cannot follow it: from "
               f"{report.first_beat_off_second:.1f} s a {events} is more than a beat off the source, at most "
               f"{abs(report.max_offset_beats):.2f} beats ({abs(report.max_offset_seconds):.2f} s, the source "
               f"{where} than the score) at {report.max_offset_second:.1f} s, and "
               f"{abs(report.end_offset_beats):.2f} beats at the last {events} ({report.end_second:.1f} s); a cover "
               "will drift out of sync there (transcribe and render it in shorter sections)")
    return TranscriptionWarning("drift", message, report.record())
