"""The native two-voice score (upstream's ABC dialect): its reader, and what its writers share.

`read_score` reads a score as upstream's parser does (the rules of `skills/yue2-music/scripts/abc_tools.py` at
commit fcb5b96, the one with tuplets; read from it, not copied) and refuses what it refuses, naming the score line
and the reason; `strip_chords` is its `strip-chords` command (the chord symbols removed, the sounding notes checked
unchanged). The instrumental edit (`instrumental.py`) and the transcription room's writer build on it. Pure: no
model, no files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import groupby

VOICES = ("Vocal", "Ins")
VOICE_DEFINITIONS = ('V: Vocal clef=treble name="Vocal Melody" snm="Vocal"',
                     'V: Ins clef=treble name="Ins Melody" snm="Inst."')
# The section labels upstream's recipe takes (its native labels, lower case as the model writes them).
SECTIONS = ("intro", "verse", "pre-chorus", "chorus", "bridge", "interlude", "outro", "instrumental")
DURATIONS = (48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1)  # note lengths (in L units) the dialect writes, longest first
MIN_LINES = 12  # the 8 header lines and one group (V: Vocal, its music, V: Ins, its music)
FINEST_UNIT = 1024  # the finest unit length L:1/N the reader takes
NATURAL = dict(zip("CDEFGAB", (0, 2, 4, 5, 7, 9, 11)))
_SHARP_ORDER, _FLAT_ORDER = "FCGDAEB", "BEADGCF"
KEYS = {**dict(zip(("Cb", "Gb", "Db", "Ab", "Eb", "Bb", "F", "C", "G", "D", "A", "E", "B", "F#", "C#"), range(-7, 8))),
        **dict(zip(("Abm", "Ebm", "Bbm", "Fm", "Cm", "Gm", "Dm", "Am", "Em", "Bm", "F#m", "C#m", "G#m", "D#m", "A#m"),
                   range(-7, 8)))}
_PITCH_NAME = r"[A-G](?:bb|##|b|#)?"
_QUALITIES = ("", "m", "dim", "aug", "7", "maj7", "m7", "dim7", "m7b5", "sus4", "sus2", "6", "m6", "7sus4", "m(maj7)")
_CHORD = re.compile(_PITCH_NAME + "(?:" + "|".join(re.escape(q) for q in _QUALITIES) + ")(?:/" + _PITCH_NAME + ")?")
_TOKEN = re.compile(r'"(?P<chord>[^"\n]*)"|\[K:(?P<key>[^\]\n]+)\]|(?P<acc>\^\^|__|\^|_|=)?(?P<note>[A-Ga-gz])'
                    r"(?P<oct>[,']*)(?P<units>[0-9]*)(?P<tie>-?)")
# A tuplet `(p`, `(p:q` or `(p:q:r` (each 2-9): the next r notes or rests (r = p when omitted) last q/p of their
# written length; without q, the ratio is the dialect's default for p (none for 5, 7 or 9).
_TUPLET = re.compile(r"\((?P<p>[2-9])(?::(?P<q>[2-9]))?(?::(?P<r>[2-9]))?")
TUPLET_DEFAULT_Q = {2: 3, 3: 2, 4: 3, 6: 2, 8: 3}
_ACCIDENTALS = {"=": 0, "_": -1, "__": -2, "^": 1, "^^": 2}


class ScoreError(ValueError):
    """A score upstream's recipe refuses; the message names the line (1-based) and the reason."""


def _fail(line: int, message: str) -> ScoreError:
    return ScoreError(f"score line {line}: {message}")


# --------------------------------------------------------------------------- reading the native dialect


@dataclass
class Voice:
    """One voice's sounding notes `[onset, pitch, duration]` (quarter notes, ties merged), bars, chords and keys,
    each with the score line it came from."""

    meter: tuple[int, int]
    time: Fraction = Fraction(0)
    notes: list = field(default_factory=list)
    note_places: list = field(default_factory=list)  # each note's (line, group/voice/bar) where it starts
    bars: list = field(default_factory=list)  # (start, length, meter)
    chords: list = field(default_factory=list)  # (time, symbol)
    keys: list = field(default_factory=list)  # (time, key)
    pending: tuple | None = None  # a tie into the next note: (pitch, written pitch)
    bar_lines: list = field(default_factory=list)  # the line of each bar
    chord_places: list = field(default_factory=list)  # each chord's (line, group/voice/bar)
    key_lines: list = field(default_factory=list)

    @property
    def key(self) -> str:
        """The key in force: the last one read."""
        return self.keys[-1][1]


@dataclass
class Score:
    lines: list[str]
    unit: Fraction
    bpm: int
    voices: dict[str, Voice]
    music_lines: dict[int, str]  # line number -> the voice it holds
    crlf: bool


def key_alterations(key: str, line: int) -> dict[str, int]:
    if key not in KEYS:
        raise _fail(line, f"unsupported key {key!r} (a standard major or minor key, as K:G or K:F#m)")
    count = KEYS[key]
    altered = (_SHARP_ORDER if count > 0 else _FLAT_ORDER)[:abs(count)]
    return {letter: (1 if count > 0 else -1) if letter in altered else 0 for letter in NATURAL}


def _power_of_two(value: int) -> bool:
    return value <= FINEST_UNIT and not value & (value - 1)


def _meter(text: str, line: int) -> tuple[int, int]:
    match = re.fullmatch(r"([1-9][0-9]*)/([1-9][0-9]*)", text)
    if match is None:
        raise _fail(line, f"unsupported meter {text!r} (an explicit fraction, as M:4/4)")
    n, d = int(match.group(1)), int(match.group(2))
    if not _power_of_two(d):
        raise _fail(line, f"unsupported meter denominator {d} (a power of two up to {FINEST_UNIT})")
    return n, d


def _open_tuplet(match: re.Match, line: int, where: str) -> list:
    """A tuplet's [notes left in it, length factor]."""
    p, q, r = (int(match.group(name)) if match.group(name) else None for name in ("p", "q", "r"))
    if q is None and p not in TUPLET_DEFAULT_Q:
        raise _fail(line, f"{where}: the tuplet ({p} has no default ratio (the dialect has one for "
                          f"{', '.join(f'({k}' for k in TUPLET_DEFAULT_Q)}); write ({p}:q")
    return [r or p, Fraction(q or TUPLET_DEFAULT_Q[p], p)]


def _read_bar(body: str, voice: Voice, unit: Fraction, line: int, where: str) -> None:
    n, d = voice.meter
    length, start, offset = Fraction(4 * n, d), voice.time, Fraction(0)
    local: dict[str, int] = {}  # accidentals hold for the rest of the bar, by letter (every octave), as upstream
    tuplet = None  # an open tuplet: [notes left in it, length factor]
    cursor = len(body) if body == "Z" else 0
    if body == "Z":
        if voice.pending is not None:
            raise _fail(line, f"{where}: a tie runs into a full-bar rest")
        offset = length
    while cursor < len(body):
        if body[cursor].isspace():
            cursor += 1
            continue
        opened = _TUPLET.match(body, cursor)
        if opened:
            if tuplet is not None:
                raise _fail(line, f"{where}: a tuplet inside a tuplet at {body[cursor:cursor + 24]!r} (upstream "
                                  "reads no nested tuplets)")
            tuplet, cursor = _open_tuplet(opened, line, where), opened.end()
            continue
        match = _TOKEN.match(body, cursor)
        if match is None:
            hint = (" (a tuplet is written (p, (p:q or (p:q:r, each a digit from 2 to 9)"
                    if body[cursor] in "(:" else "")
            raise _fail(line, f"{where}: notation the native dialect does not have at {body[cursor:cursor + 24]!r}"
                              + hint)
        cursor = match.end()
        if offset >= length:
            raise _fail(line, f"{where}: an event after the end of the bar")
        chord, key = match.group("chord", "key")
        if chord is not None:
            if _CHORD.fullmatch(chord) is None:
                raise _fail(line, f"{where}: unsupported chord symbol {chord!r}")
            voice.chords.append((start + offset, chord))
            voice.chord_places.append((line, where))
            continue
        if key is not None:
            key_alterations(key, line)
            voice.keys.append((start + offset, key))
            voice.key_lines.append(line)
            local = {}
            continue
        note, acc, octave, tie = match.group("note", "acc", "oct", "tie")
        units = int(match.group("units") or "1")
        if units not in DURATIONS:
            raise _fail(line, f"{where}: unsupported length {units} (the dialect writes {sorted(DURATIONS)} units; "
                              "tie longer notes)")
        duration = units * unit * 4
        if tuplet is not None:
            duration *= tuplet[1]
            tuplet[0] -= 1
            tuplet = tuplet if tuplet[0] else None
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
                    raise _fail(line, f"{where}: pitch {pitch} is outside the MIDI range 0-127")
                voice.notes.append([start + offset, pitch, duration])
                voice.note_places.append((line, where))
            voice.pending = (pitch, written) if tie else None
        offset += duration
    if tuplet is not None:
        raise _fail(line, f"{where}: a tuplet is still open at the end of the bar ({tuplet[0]} more note"
                          f"{'s' if tuplet[0] > 1 else ''} or rest{'s' if tuplet[0] > 1 else ''} expected)")
    if offset != length:
        raise _fail(line, f"{where}: the bar holds {offset} quarter notes, its meter {n}/{d} takes {length}")
    voice.bars.append((start, length, voice.meter))
    voice.bar_lines.append(line)
    voice.time += length


def _shown(lines: list[str], number: int) -> str:
    return repr(lines[number - 1]) if len(lines) >= number else "the end of the score"


def _read_header(lines: list[str]) -> tuple[tuple[int, int], Fraction, int, str]:
    for number, wanted, what in ((1, "X:1", "'X:1'"), (2, "T:", "a blank title 'T:'")):
        if lines[number - 1] != wanted:
            raise _fail(number, f"expected {what} (the native header), got {_shown(lines, number)}")
    if not lines[2].startswith("M:"):
        raise _fail(3, f"expected the meter M:, got {_shown(lines, 3)}")
    meter = _meter(lines[2][2:], 3)
    unit = re.fullmatch(r"L:1/([1-9][0-9]*)", lines[3])
    if unit is None:
        raise _fail(4, f"expected the unit length L:1/<power of two>, got {_shown(lines, 4)}")
    if not _power_of_two(int(unit.group(1))):
        raise _fail(4, f"unsupported unit length {lines[3]} (a power of two up to L:1/{FINEST_UNIT})")
    tempo = re.fullmatch(r"Q:1/4=([1-9][0-9]*)", lines[4])
    if tempo is None:
        raise _fail(5, f"expected the tempo Q:1/4=<BPM> (a whole number), got {_shown(lines, 5)}")
    for number, (name, definition) in enumerate(zip(VOICES, VOICE_DEFINITIONS), start=6):
        if lines[number - 1] != definition:
            raise _fail(number, f"expected the native {name} voice definition {definition!r}, got "
                                f"{_shown(lines, number)}")
    if not lines[7].startswith("K:"):
        raise _fail(8, f"expected the key K: (the header defines exactly the Vocal and Ins voices), got "
                       f"{_shown(lines, 8)}")
    key_alterations(lines[7][2:], 8)
    return meter, Fraction(1, int(unit.group(1))), int(tempo.group(1)), lines[7][2:]


def _read_group(lines: list[str], cursor: int, group: int, voices: dict[str, Voice], unit: Fraction,
                music_lines: dict[int, str]) -> int:
    """One group's V: Vocal and V: Ins, their M:/K: fields and music lines from line index `cursor`; the next index."""
    counts = []
    for name in VOICES:
        where = f"group {group}, {name}"
        if cursor >= len(lines) or lines[cursor] != f"V: {name}":
            raise _fail(min(cursor, len(lines) - 1) + 1, f"{where}: expected 'V: {name}', got "
                                                         f"{_shown(lines, cursor + 1)}")
        cursor += 1
        voice, seen = voices[name], set()
        while cursor < len(lines) and lines[cursor].startswith(("M:", "K:")):
            field_name, value = lines[cursor].split(":", 1)
            if field_name in seen:
                raise _fail(cursor + 1, f"{where}: a second {field_name}: field")
            seen.add(field_name)
            if field_name == "M":
                voice.meter = _meter(value, cursor + 1)
            else:
                key_alterations(value, cursor + 1)
                voice.keys.append((voice.time, value))
                voice.key_lines.append(cursor + 1)
            cursor += 1
        if cursor >= len(lines):
            raise _fail(len(lines), f"{where}: the music line is missing")
        line, number = lines[cursor], cursor + 1
        if not line.endswith("|"):
            raise _fail(number, f"{where}: a music line must end with a plain barline '|', got {line!r}")
        music_lines[number] = name
        bars = []
        for bar in line[:-1].split("|"):
            bar = bar.strip()
            if not bar:
                raise _fail(number, f"{where}: an empty bar or a double/repeat barline")
            rest = re.fullmatch(r"Z([2-4])?", bar)
            bars.extend(["Z"] * int(rest.group(1) or "1") if rest else [bar])
        if not 1 <= len(bars) <= 4:
            raise _fail(number, f"{where}: {len(bars)} bars (a line holds 1-4 once Z2-Z4 rests are counted)")
        counts.append(len(bars))
        for bar in bars:
            _read_bar(bar, voice, unit, number, f"{where}, bar {len(voice.bars) + 1}")
        cursor += 1
    if counts[0] != counts[1]:
        raise _fail(cursor, f"group {group}: Vocal has {counts[0]} bars, Ins {counts[1]}")
    return cursor


def read_score(text: str) -> Score:
    """The native two-voice score `text` as upstream's parser reads it (any line ending), or a ScoreError naming
    the line that is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise _fail(1, "the score is blank (upstream's recipe needs a native score)")
    lines = text.splitlines()
    if len(lines) < MIN_LINES:
        raise _fail(len(lines), f"the score ends after {len(lines)} lines; a native score has the 8 header lines "
                                "and at least one group of V: Vocal and V: Ins music lines")
    meter, unit, bpm, key = _read_header(lines)
    voices = {name: Voice(meter, keys=[(Fraction(0), key)], key_lines=[8]) for name in VOICES}
    music_lines: dict[int, str] = {}
    cursor, group = 8, 0
    while cursor < len(lines):
        while cursor < len(lines) and lines[cursor].startswith("% "):
            cursor += 1
        if cursor == len(lines):
            raise _fail(cursor, "a section comment with no music after it")
        group += 1
        cursor = _read_group(lines, cursor, group, voices, unit, music_lines)
    vocal, ins = voices["Vocal"], voices["Ins"]
    for name, voice in voices.items():
        if voice.pending is not None:
            raise _fail(voice.bar_lines[-1], f"{name}: a tie is left open at the end of the score")
    if ins.chords:
        raise _fail(ins.chord_places[0][0], f"a chord symbol in Ins ({ins.chords[0][1]!r}); the native dialect "
                                            "keeps chord symbols in Vocal")
    if vocal.bars != ins.bars:
        bar = next((i for i, (a, b) in enumerate(zip(vocal.bars, ins.bars)) if a != b), len(ins.bars) - 1)
        raise _fail(ins.bar_lines[bar], f"Vocal and Ins differ in meter from bar {bar + 1} on")
    if vocal.keys != ins.keys:
        index = next((i for i, (a, b) in enumerate(zip(vocal.keys, ins.keys)) if a != b),
                     min(len(vocal.keys), len(ins.keys)))
        longer = ins if index < len(ins.key_lines) else vocal
        raise _fail(longer.key_lines[index], "Vocal and Ins change key at different times or to different keys")
    return Score(lines, unit, bpm, voices, music_lines, "\r\n" in text)


def section_labels(score: Score) -> tuple[tuple[int, str], ...]:
    """Each `% label` of a read score and the index (0-based) of the Vocal bar its group starts with (of a stack of
    labels before one group, the last). The label is the comment's text stripped: the writers write `% ` and the
    bare label, so a hand-edited `%  chorus ` names the same section as theirs."""
    vocal, pending, found = score.voices["Vocal"], None, []
    for number, line in enumerate(score.lines, start=1):
        if line.startswith("% "):
            pending = line[2:].strip()
        elif score.music_lines.get(number) == "Vocal" and pending is not None:
            found.append((vocal.bar_lines.index(number), pending))
            pending = None
    return tuple(found)


def strip_chords(text: str, keep_voice: str = "both") -> str:
    """Upstream's `abc_tools.py strip-chords`: the score with every chord symbol removed from its music lines (and,
    with `keep_voice` "Vocal" or "Ins", the other voice's notes turned into rests of the same length), the rest of
    the text as it was; refused (a ScoreError) unless the kept voices' sounding notes and bars read back unchanged,
    no chord symbol is left and the other voice is silent."""
    if keep_voice not in ("both", *VOICES):
        raise ValueError(f"keep_voice must be 'both', 'Vocal' or 'Ins', got {keep_voice!r}")
    source = read_score(text)
    lines = text.splitlines(keepends=True)

    def stripped(match: re.Match, voice: str) -> str:
        if match.group("chord") is not None:
            return ""
        if keep_voice != "both" and voice != keep_voice and match.group("note") is not None:
            return "z" + match.group("units")
        return match.group(0)

    for number, voice in source.music_lines.items():
        lines[number - 1] = _TOKEN.sub(lambda match: stripped(match, voice), lines[number - 1])
    output = "".join(lines)
    result = read_score(output)
    kept = VOICES if keep_voice == "both" else (keep_voice,)
    last = len(result.lines)
    for name in kept:
        before, after = source.voices[name], result.voices[name]
        if before.bars != after.bars or before.notes != after.notes:
            raise _fail(last, f"removing the chord symbols changed the {name} voice's bars or sounding notes")
    if any(voice.chords for voice in result.voices.values()):
        raise _fail(last, "a chord symbol is left after removing them")
    if any(voice.notes for name, voice in result.voices.items() if name not in kept):
        raise _fail(last, f"the voice other than {keep_voice} still sounds")
    return output


# --------------------------------------------------------------------------- what the writers share


def split_length(units: Fraction) -> list[int]:
    """A length in units as the dialect's note lengths, longest first (tied)."""
    pieces, left = [], int(units)
    for piece in DURATIONS:
        while left >= piece:
            pieces.append(piece)
            left -= piece
    return pieces


def sized(token: str, count: int) -> str:
    return token + (str(count) if count != 1 else "")


def music_line(bars: list[str]) -> str:
    """A music line, each run of full-bar rests written as one Z, Z2, Z3 or Z4."""
    parts = []
    for rest, run in groupby(bars, key=lambda bar: bar == "Z"):
        run = list(run)
        parts += [sized("Z", len(run))] if rest else run
    return "".join(part + "|" for part in parts)


def meter_text(meter: tuple[int, int]) -> str:
    return f"{meter[0]}/{meter[1]}"


def write_score(bars: list, texts: dict[str, list[str]], bpm: int, unit: int) -> str:
    """A native score from its bars (each with its `meter`, `key` and `section`, None for none) and each voice's
    written bars (`texts[voice][i]`, "Z" for a full-bar rest): the header from the first bar, then groups of up to
    four bars that break where the meter, key or section changes; a section's label is written where it changes, an
    M: or K: field in each voice where the meter or key does."""
    lines = ["X:1", "T:", "M:" + meter_text(bars[0].meter), f"L:1/{unit}", f"Q:1/4={bpm}", *VOICE_DEFINITIONS,
             "K:" + bars[0].key]
    index = 0
    while index < len(bars):
        first, before = bars[index], bars[index - 1] if index else bars[index]
        end = index + 1
        while end < len(bars) and end - index < 4 and (bars[end].meter, bars[end].key, bars[end].section) == \
                (first.meter, first.key, first.section):
            end += 1
        if first.section is not None and (index == 0 or first.section != before.section):
            lines.append("% " + first.section)
        for name in VOICES:
            lines.append(f"V: {name}")
            lines += ["M:" + meter_text(first.meter)] if first.meter != before.meter else []
            lines += ["K:" + first.key] if first.key != before.key else []
            lines.append(music_line(texts[name][index:end]))
        index = end
    return "\n".join(lines) + "\n"
