"""Instrumental songs as upstream's recipe makes them: plan a score, move its vocal melody to the instrument, render.

Upstream (`examples/instrumental_clip.py` and the `skills/yue2-music` instrumental scripts) has no switch: it
1. plans a score with `cot="full"` and the lyrics `PLANNING_LYRICS` (section tags, no words),
2. refuses a planned score that is empty or truncated,
3. edits the score (`convert_score(overlap="vocal", keep_chords=True)`): every sounding Vocal note moves to the Ins
   voice, where the vocal note wins (an Ins note it overlaps keeps only the parts outside it); Vocal keeps its chord
   symbols over rests; meter, key, tempo and the bar grid stay,
4. renders the edited score as an external score with the style `instrumental_style(style)`, the lyrics
   `lyric_tags(score)` (the score's `% section` names as `[Section]` tags, never sung words) and the cot the
   score allows (`full` when Vocal keeps chord symbols, else `melody`), with the same seed.

The score dialect is the native two-voice one YuE2 writes (X:1, T:, M:, L:1/N, Q:1/4=BPM, the Vocal and Ins voice
definitions, K:, then groups of `V: Vocal` / `V: Ins` music lines of 1-4 bars under `% section` comments). It has no
lyric (`w:`) lines, MIDI programs or other voices; a score with them, or with any other line upstream's parser
refuses, is refused here with its line number. This module is pure: no model, no files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

PLANNING_LYRICS = "[Intro]\n\n[Verse]\n\n[Chorus]\n\n[Outro]\n"  # upstream's planning lyrics: tags, no words
PLANNING_COT = "full"  # upstream plans with a chord-annotated score
NO_SINGING = ("no vocals", "no singing", "no choir", "no spoken words")  # upstream's style conditions, in order
VOICES = ("Vocal", "Ins")
VOICE_DEFINITIONS = ('V: Vocal clef=treble name="Vocal Melody" snm="Vocal"',
                     'V: Ins clef=treble name="Ins Melody" snm="Inst."')
DURATIONS = (48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1)  # note lengths (in L units) the dialect writes, longest first
NATURAL = dict(zip("CDEFGAB", (0, 2, 4, 5, 7, 9, 11)))
_SHARP_ORDER, _FLAT_ORDER = "FCGDAEB", "BEADGCF"
KEYS = {**dict(zip(("Cb", "Gb", "Db", "Ab", "Eb", "Bb", "F", "C", "G", "D", "A", "E", "B", "F#", "C#"), range(-7, 8))),
        **dict(zip(("Abm", "Ebm", "Bbm", "Fm", "Cm", "Gm", "Dm", "Am", "Em", "Bm", "F#m", "C#m", "G#m", "D#m", "A#m"),
                   range(-7, 8)))}
_PITCH_NAME = r"[A-G](?:bb|##|b|#)?"
_QUALITIES = ("", "m", "dim", "aug", "7", "maj7", "m7", "dim7", "m7b5", "sus4", "sus2", "6", "m6", "7sus4", "m(maj7)")
_CHORD = re.compile(_PITCH_NAME + "(?:" + "|".join(re.escape(q) for q in _QUALITIES) + ")(?:/" + _PITCH_NAME + ")?")
_TOKEN = re.compile(r'"(?P<chord>[^"\n]*)"|(?P<acc>\^\^|__|\^|_|=)?(?P<note>[A-Ga-gz])(?P<oct>[,\']*)'
                    r"(?P<units>[0-9]*)(?P<tie>-?)")
_ACCIDENTALS = {"=": 0, "_": -1, "__": -2, "^": 1, "^^": 2}
RECIPE = ("upstream examples/instrumental_clip.py: plan (cot full, PLANNING_LYRICS), "
          "convert_score(overlap='vocal', keep_chords=True), render with instrumental_style and lyric_tags")


class ScoreError(ValueError):
    """A score the edit cannot take; the message names the line (1-based) that is wrong."""


def _fail(line: int | None, message: str) -> ScoreError:
    return ScoreError(f"score line {line}: {message}" if line is not None else f"score: {message}")


# --------------------------------------------------------------------------- reading the native dialect


@dataclass
class Voice:
    """One voice's sounding notes `[onset, pitch, duration]` (quarter notes, ties merged), bars and chords."""

    meter: tuple[int, int]
    key: str
    time: Fraction = Fraction(0)
    notes: list = field(default_factory=list)
    bars: list = field(default_factory=list)  # (start, length, meter)
    chords: list = field(default_factory=list)  # (time, symbol)
    keys: list = field(default_factory=list)  # (time, key)
    pending: tuple | None = None  # a tie into the next note: (pitch, written pitch)


@dataclass
class Group:
    """A group of music lines: its `% section` comments, each voice's field lines (M:, K:) and bar count."""

    comments: list[str]
    fields: dict[str, list[str]]
    bars: int
    lines: dict[str, int]  # voice -> the music line's number (1-based)


@dataclass
class Score:
    header: list[str]
    unit: Fraction
    bpm: int
    voices: dict[str, Voice]
    groups: list[Group]
    crlf: bool


def key_alterations(key: str, line: int | None) -> dict[str, int]:
    if key not in KEYS:
        raise _fail(line, f"unsupported key {key!r} (a standard major or minor K: field)")
    count = KEYS[key]
    altered = (_SHARP_ORDER if count > 0 else _FLAT_ORDER)[:abs(count)]
    return {letter: (1 if count > 0 else -1) if letter in altered else 0 for letter in NATURAL}


def _meter(text: str, line: int) -> tuple[int, int]:
    match = re.fullmatch(r"([1-9][0-9]*)/([1-9][0-9]*)", text)
    if match is None:
        raise _fail(line, f"unsupported meter {text!r} (an explicit fraction, as M:4/4)")
    n, d = int(match.group(1)), int(match.group(2))
    if d > 1024 or d & (d - 1):
        raise _fail(line, f"unsupported meter denominator {d}")
    return n, d


def _bar(body: str, voice: Voice, unit: Fraction, line: int, where: str) -> None:
    n, d = voice.meter
    length, start, offset = Fraction(4 * n, d), voice.time, Fraction(0)
    local: dict[str, int] = {}  # accidentals hold for the rest of the bar, by letter (every octave), as upstream
    if body == "Z":
        if voice.pending is not None:
            raise _fail(line, f"{where}: a tie runs into a full-bar rest")
        offset = length
    cursor = 0 if body != "Z" else len(body)
    while cursor < len(body):
        if body[cursor].isspace():
            cursor += 1
            continue
        if body[cursor] == "(":
            raise _fail(line, f"{where}: a tuplet ({body[cursor:cursor + 4]!r}); the instrumental edit cannot "
                              "re-spell tuplets")
        if body.startswith("[K:", cursor):
            raise _fail(line, f"{where}: an inline key change; the instrumental edit takes key changes as K: lines")
        match = _TOKEN.match(body, cursor)
        if match is None:
            raise _fail(line, f"{where}: unsupported token at {body[cursor:cursor + 24]!r}")
        cursor = match.end()
        if offset >= length:
            raise _fail(line, f"{where}: an event after the end of the bar")
        chord = match.group("chord")
        if chord is not None:
            if _CHORD.fullmatch(chord) is None:
                raise _fail(line, f"{where}: unsupported chord {chord!r}")
            voice.chords.append((start + offset, chord))
            continue
        note, acc, octave, tie = match.group("note", "acc", "oct", "tie")
        units = int(match.group("units") or "1")
        if units not in DURATIONS:
            raise _fail(line, f"{where}: unsupported duration {units} (the dialect writes {sorted(DURATIONS)})")
        duration = units * unit * 4
        if offset + duration > length:
            raise _fail(line, f"{where}: a note or rest runs past the end of the bar")
        if "," in octave and "'" in octave:
            raise _fail(line, f"{where}: mixed octave marks {octave!r}")
        if note == "z":
            if acc or octave or tie:
                raise _fail(line, f"{where}: a rest with an accidental, octave mark or tie")
            if voice.pending is not None:
                raise _fail(line, f"{where}: a tie runs into a rest")
        else:
            letter = note.upper()
            written = 60 + NATURAL[letter] + (12 if note.islower() else 0) + 12 * (octave.count("'") - octave.count(","))
            alteration = local.get(letter, key_alterations(voice.key, line)[letter])
            if acc:
                alteration = local[letter] = _ACCIDENTALS[acc]
            pitch = written + alteration
            if voice.pending is not None:
                held, held_written = voice.pending
                if not acc and written == held_written:  # an unmarked continuation keeps the tied pitch
                    pitch = held
                if pitch != held:
                    raise _fail(line, f"{where}: a tie changes the pitch from {held} to {pitch}")
                voice.notes[-1][2] += duration
            else:
                if not 0 <= pitch <= 127:
                    raise _fail(line, f"{where}: pitch {pitch} is outside the MIDI range")
                voice.notes.append([start + offset, pitch, duration])
            voice.pending = (pitch, written) if tie else None
        offset += duration
    if offset != length:
        raise _fail(line, f"{where}: the bar holds {offset} quarter notes, its meter {n}/{d} takes {length}")
    voice.bars.append((start, length, voice.meter))
    voice.time += length


def read_score(text: str) -> Score:
    """The native two-voice score `text`, or a ScoreError naming the line that is wrong (CRLF is read as LF)."""
    if not isinstance(text, str) or not text.strip():
        raise _fail(None, "must be non-blank ABC text")
    crlf = "\r\n" in text
    lines = text.splitlines()
    expected_header = [("X:1", "X:1"), ("T:", "a blank title T:")]
    for number, (wanted, what) in enumerate(expected_header, start=1):
        if len(lines) < number or lines[number - 1] != wanted:
            raise _fail(number, f"expected {what} (the native header), got {_shown(lines, number)}")
    if len(lines) < 3 or not lines[2].startswith("M:"):
        raise _fail(3, f"expected the meter M:, got {_shown(lines, 3)}")
    meter = _meter(lines[2][2:], 3)
    unit_match = re.fullmatch(r"L:1/([1-9][0-9]*)", lines[3] if len(lines) > 3 else "")
    if unit_match is None or int(unit_match.group(1)) > 1024 or int(unit_match.group(1)) & (int(unit_match.group(1)) - 1):
        raise _fail(4, f"expected the unit length L:1/<power of two>, got {_shown(lines, 4)}")
    unit = Fraction(1, int(unit_match.group(1)))
    tempo = re.fullmatch(r"Q:1/4=([1-9][0-9]*)", lines[4] if len(lines) > 4 else "")
    if tempo is None:
        raise _fail(5, f"expected the tempo Q:1/4=<BPM>, got {_shown(lines, 5)}")
    for offset, (name, definition) in enumerate(zip(VOICES, VOICE_DEFINITIONS)):
        if len(lines) <= 5 + offset or lines[5 + offset] != definition:
            raise _fail(6 + offset, f"expected the native {name} voice definition {definition!r}, got "
                                    f"{_shown(lines, 6 + offset)} (the score must have exactly the Vocal and Ins "
                                    "voices)")
    if len(lines) < 8 or not lines[7].startswith("K:"):
        raise _fail(8, f"expected the key K:, got {_shown(lines, 8)}")
    key = lines[7][2:]
    key_alterations(key, 8)
    voices = {name: Voice(meter, key, keys=[(Fraction(0), key)]) for name in VOICES}
    groups: list[Group] = []
    cursor = 8
    while cursor < len(lines):
        comments = []
        while cursor < len(lines) and lines[cursor].startswith("% "):
            comments.append(lines[cursor])
            cursor += 1
        if cursor == len(lines):
            raise _fail(cursor, "a section comment with no music after it")
        group = Group(comments, {}, 0, {})
        counts = []
        for name in VOICES:
            where = f"group {len(groups) + 1}, {name}"
            if cursor >= len(lines) or lines[cursor] != f"V: {name}":
                raise _fail(cursor + 1, f"{where}: expected 'V: {name}', got {_shown(lines, cursor + 1)}")
            cursor += 1
            voice, seen, group.fields[name] = voices[name], set(), []
            while cursor < len(lines) and lines[cursor].startswith(("M:", "K:")):
                field_name, value = lines[cursor].split(":", 1)
                if field_name in seen:
                    raise _fail(cursor + 1, f"{where}: a second {field_name}: field")
                seen.add(field_name)
                if field_name == "M":
                    voice.meter = _meter(value, cursor + 1)
                else:
                    key_alterations(value, cursor + 1)
                    voice.key = value
                    voice.keys.append((voice.time, value))
                group.fields[name].append(lines[cursor])
                cursor += 1
            if cursor >= len(lines):
                raise _fail(cursor, f"{where}: the music line is missing")
            line = lines[cursor]
            if not line.endswith("|"):
                raise _fail(cursor + 1, f"{where}: a music line must end with a plain barline '|', got {line!r}")
            group.lines[name] = cursor + 1
            bars = []
            for bar in line[:-1].split("|"):
                bar = bar.strip()
                if not bar:
                    raise _fail(cursor + 1, f"{where}: an empty bar or a double/repeat barline")
                rest = re.fullmatch(r"Z([2-4])?", bar)
                bars.extend(["Z"] * int(rest.group(1) or "1") if rest else [bar])
            if not 1 <= len(bars) <= 4:
                raise _fail(cursor + 1, f"{where}: {len(bars)} bars (a line holds 1-4 once Z rests are counted)")
            counts.append(len(bars))
            for bar in bars:
                _bar(bar, voice, unit, cursor + 1, f"{where}, bar {len(voice.bars) + 1}")
            cursor += 1
        if counts[0] != counts[1]:
            raise _fail(cursor, f"group {len(groups) + 1}: Vocal has {counts[0]} bars, Ins {counts[1]}")
        group.bars = counts[0]
        groups.append(group)
    if not groups:
        raise _fail(len(lines), "the score has no music")
    for name, voice in voices.items():
        if voice.pending is not None:
            raise _fail(len(lines), f"{name}: a tie is left open at the end of the score")
    if voices["Ins"].chords:
        raise _fail(None, "Ins holds chord symbols (the native dialect keeps them in Vocal)")
    if voices["Vocal"].bars != voices["Ins"].bars or voices["Vocal"].keys != voices["Ins"].keys:
        raise _fail(None, "the Vocal and Ins voices have different meters, bars or key changes")
    return Score(lines[:8], unit, int(tempo.group(1)), voices, groups, crlf)


def _shown(lines: list[str], number: int) -> str:
    return repr(lines[number - 1]) if len(lines) >= number else "the end of the score"


# --------------------------------------------------------------------------- writing it back


def _lengths(units: int) -> list[int]:
    pieces = []
    while units:
        piece = next(d for d in DURATIONS if d <= units)
        pieces.append(piece)
        units -= piece
    return pieces


def _spell(pitch: int, key: dict[str, int], local: dict[str, int]) -> tuple[str, str, int | None]:
    """(accidental, letter+octave, the alteration it sets or None): no accidental where the key or the bar's
    earlier accidentals already give the pitch; else a natural, else a sharp (a flat in a flat key)."""
    options = [(letter, local.get(letter, key[letter]), None) for letter in NATURAL]
    direction = -1 if any(v < 0 for v in key.values()) else 1
    options += [(letter, alt, alt) for alt in (0, direction, -direction) for letter in NATURAL]
    for letter, alteration, sets in options:
        written = pitch - alteration
        if (written - NATURAL[letter]) % 12 == 0:
            octave = (written - 60 - NATURAL[letter]) // 12
            name = letter.lower() + "'" * (octave - 1) if octave >= 1 else letter + "," * -octave
            mark = "" if sets is None else {0: "=", 1: "^", -1: "_"}[sets]
            return mark, name, sets
    raise AssertionError(pitch)  # every pitch has a sharp or flat spelling


def _render_bar(notes: list, chords: list, start: Fraction, length: Fraction, key: dict[str, int], unit: Fraction,
                held: str | None, line: int) -> tuple[str, str | None]:
    """One bar's text and the spelling a tie carries into the next bar. `notes` never overlap."""
    end = start + length
    inside = [n for n in notes if n[0] < end and n[0] + n[2] > start]
    times = [t for t, _ in chords if start <= t < end]
    if not inside and not times:
        return "Z", None
    cuts = sorted({start, end, *(max(start, n[0]) for n in inside), *(min(end, n[0] + n[2]) for n in inside),
                   *times})
    text, local = [], {}
    for a, b in zip(cuts, cuts[1:]):
        text.extend(f'"{symbol}"' for t, symbol in chords if t == a)
        note = next((n for n in inside if n[0] <= a < n[0] + n[2]), None)
        units = (b - a) / (4 * unit)
        if units.denominator != 1:
            raise _fail(line, f"a length of {b - a} quarter notes cannot be written in L:1/{unit.denominator}")
        pieces = _lengths(int(units))
        for index, count in enumerate(pieces):
            size = str(count) if count != 1 else ""
            if note is None:
                text.append("z" + size)
                continue
            if held is None:  # the note's first piece: spelled against the key and the bar's accidentals
                mark, held, sets = _spell(note[1], key, local)
                if sets is not None:
                    local[held[0].upper()] = sets
            else:  # a tied continuation: the same letter and octave, unmarked, keeps the pitch
                mark = ""
            more = index < len(pieces) - 1 or b < note[0] + note[2]
            text.append(mark + held + size + ("-" if more else ""))
            if not more:
                held = None
    return "".join(text), held


def _line(bars: list[str]) -> str:
    """A music line: runs of full-bar rests written Z2..Z4, as upstream's scores do."""
    out, run = [], 0
    for bar in bars + [None]:
        if bar == "Z":
            run += 1
            continue
        while run:
            step = min(run, 4)
            out.append("Z" if step == 1 else f"Z{step}")
            run -= step
        if bar is not None:
            out.append(bar)
    return "|".join(out) + "|"


def _write(score: Score, tracks: dict[str, tuple[list, list]]) -> str:
    lines = list(score.header)
    bar = 0
    held = {name: None for name in VOICES}
    for group in score.groups:
        lines.extend(group.comments)
        for name in VOICES:
            notes, chords = tracks[name]
            lines.append(f"V: {name}")
            lines.extend(group.fields[name])
            voice = score.voices[name]
            texts = []
            for index in range(bar, bar + group.bars):
                start, length, _ = voice.bars[index]
                key = next(k for t, k in reversed(voice.keys) if t <= start)
                text, held[name] = _render_bar(notes, chords, start, length, key_alterations(key, None), score.unit,
                                               held[name], group.lines[name])
                texts.append(text)
            lines.append(_line(texts))
        bar += group.bars
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the edit


@dataclass(frozen=True)
class ScoreEdit:
    """The edited score and what the edit changed (`changes`, JSON-ready)."""

    source: str
    text: str
    changes: dict

    @property
    def cot(self) -> str:
        return self.changes["render_cot"]


def _outside(start: Fraction, duration: Fraction, occupied: list) -> list[tuple[Fraction, Fraction]]:
    pieces = [(start, start + duration)]
    for left, right in occupied:
        pieces = [part for a, b in pieces for part in
                  ([(a, b)] if right <= a or left >= b else [p for p in ((a, left), (right, b)) if p[0] < p[1]])]
    return pieces


def edit_score(text: str) -> ScoreEdit:
    """Upstream's instrumental edit of a native score: Vocal's sounding notes move to Ins (a vocal note wins over the
    part of an Ins note it overlaps), Vocal keeps its chord symbols over rests; a ScoreError names a wrong line."""
    score = read_score(text)
    vocal, ins = score.voices["Vocal"], score.voices["Ins"]
    if not vocal.notes and not ins.notes:
        raise _fail(None, "the score has no sounding notes")
    occupied = [(t, t + d) for t, _, d in vocal.notes]
    merged = [list(n) for n in vocal.notes]
    trimmed, unchanged = [], 0
    for index, (start, pitch, duration) in enumerate(ins.notes):
        pieces = _outside(start, duration, occupied)
        if pieces == [(start, start + duration)]:
            unchanged += 1
        else:
            trimmed.append({"ins_note": index, "onset": str(start), "pitch": pitch, "duration": str(duration),
                            "kept": [[str(a), str(b - a)] for a, b in pieces]})
        merged.extend([a, pitch, b - a] for a, b in pieces)
    merged.sort()
    chords = []
    for when, symbol in vocal.chords:
        if chords and chords[-1][0] == when:
            if chords[-1][1] != symbol:
                raise _fail(None, f"two different chord symbols at quarter note {when}")
            continue
        chords.append((when, symbol))
    for _, _, (_, d) in ins.bars:  # upstream refuses a unit too coarse for four subbeats per beat
        if score.unit.denominator % (4 * d):
            raise _fail(4, f"L:1/{score.unit.denominator} is too coarse for the four-subbeat grid of a /{d} meter")
    edited = _write(score, {"Vocal": ([], chords), "Ins": (merged, [])})
    check = read_score(edited)  # the written score must read back as the intended events
    if check.voices["Ins"].notes != merged or check.voices["Vocal"].notes or check.voices["Vocal"].chords != chords \
            or check.voices["Ins"].bars != ins.bars:
        raise _fail(None, "the instrumental edit could not write the moved notes back exactly (please report it "
                          "with the score)")
    before, after = text.replace("\r\n", "\n").split("\n"), edited.split("\n")
    changes = {
        "recipe": RECIPE,
        "vocal_notes_moved_to_ins": len(vocal.notes),
        "ins_notes_before": len(ins.notes), "ins_notes_unchanged": unchanged, "ins_notes_after": len(merged),
        "ins_notes_trimmed_under_vocal": trimmed,
        "chords_kept_in_vocal": len(chords),
        "render_cot": "full" if chords else "melody",
        "lines_changed": [n for n, (a, b) in enumerate(zip(before, after), start=1) if a != b],
        "line_endings": "crlf read as lf" if score.crlf else "lf",
        "bpm": score.bpm, "nominal_seconds": float(vocal.time * 60 / score.bpm),
    }
    return ScoreEdit(text, edited, changes)


def instrumental_style(style: str) -> str:
    """Upstream's style for the render: 'Instrumental, ' first (unless it already starts so), then each of
    no vocals / no singing / no choir / no spoken words that it lacks, ending with a full stop."""
    style = style.strip().rstrip(".,")
    if not re.match(r"^instrumental\b", style, re.I):
        style = "Instrumental, " + style
    for condition in NO_SINGING:
        if condition not in style.lower():
            style += ", " + condition
    return style + "."


def lyric_tags(text: str) -> str:
    """Upstream's render lyrics: the score's `% section` comments as `[Section]` tags, never sung words."""
    labels = [line[2:] for line in text.splitlines() if line.startswith("% ")]
    return "\n\n".join(f"[{label.title()}]" for label in labels) + ("\n" if labels else "")


# --------------------------------------------------------------------------- requests


def planning_request(request):
    """The request that plans the score: the style as given, the given lyrics (upstream's PLANNING_LYRICS when none)
    and the request's cot (upstream's is full), seed and id."""
    from dataclasses import replace

    lyrics = request.lyrics if request.lyrics.strip() else PLANNING_LYRICS
    return replace(request, lyrics=lyrics, instrumental=False, abc=None)


def render_request(request, edit: ScoreEdit):
    """The request that renders the edited score, as upstream builds it."""
    from dataclasses import replace

    lyrics = lyric_tags(edit.text)
    if not lyrics:
        raise _fail(None, "the score has no '% section' comment, so upstream's recipe has no section tags to render "
                          "it with")
    return replace(request, style=instrumental_style(request.style), lyrics=lyrics, abc=edit.text, cot=edit.cot,
                   instrumental=False)


def admission_request(request):
    """What a song's admission checks: the render request of a given score, else the planning request."""
    return render_request(request, edit_score(request.abc)) if request.abc is not None else planning_request(request)


@dataclass(frozen=True)
class InstrumentalSteps:
    """Each step of the recipe for one song: the planned score (the model's or the given one), the edit, and the
    request that renders it; `record()` is instrumental.json."""

    planned: str
    planned_by: str  # "model" or "request"
    planning: dict | None
    edit: ScoreEdit
    render: object  # SongRequest
    timing: dict

    def record(self) -> dict:
        return {"recipe": RECIPE, "planned_by": self.planned_by, "planning_request": self.planning,
                "planned_score": "planned.abc", "edited_score": "score.abc", "changes": self.edit.changes,
                "render_request": self.render.to_dict()}


def plan_steps(request, plan_score: Callable) -> InstrumentalSteps:
    """Steps 1-3 of the recipe: plan (unless the request gives its score) with `plan_score(planning request)` (a
    SymbolicPlan), refuse an empty or truncated score, edit it, and build the render request."""
    if request.abc is not None:
        planned, by, planning, timing = request.abc, "request", None, {}
    else:
        asked = planning_request(request)
        plan = plan_score(asked)
        if plan.truncated or not (plan.abc or "").strip():
            raise ValueError("the planned score was " + ("truncated" if plan.truncated else "empty")
                             + "; upstream's recipe stops here (try another seed)")
        planned, by, planning, timing = plan.abc, "model", asked.to_dict(), dict(plan.timing)
    try:
        edit = edit_score(planned)
    except ScoreError as exc:
        raise ScoreError(f"the {'planned' if by == 'model' else 'given'} {exc}") from None
    return InstrumentalSteps(planned, by, planning, edit, render_request(request, edit), timing)


def plan_files(steps: InstrumentalSteps) -> dict[str, bytes]:
    """The plan stage's extra files of an instrumental song: the planned score (as planned or given) and
    instrumental.json (the steps and what the edit changed); score.abc holds the edited score."""
    from .checkpoint import json_text

    return {"planned.abc": steps.planned.encode("utf-8"),
            "instrumental.json": (json_text(steps.record(), indent=2) + "\n").encode("utf-8")}


def rendered_request(meta: dict, request):
    """The request a planned stage renders: an instrumental song's render request, else the song's own."""
    record = meta.get("instrumental")
    return type(request).from_dict(record["render_request"]) if record else request
