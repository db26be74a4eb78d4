"""Instrumental songs as upstream's recipe makes them: plan a score, move its vocal melody to the instrument, render.

Upstream (`examples/instrumental_clip.py` and the `skills/yue2-music` instrumental scripts) has no switch: it
1. plans a score with `cot="full"` and the lyrics `PLANNING_LYRICS` (section tags, no words),
2. refuses a planned score that is empty or truncated,
3. edits the score (`convert_score(overlap="vocal", keep_chords=True)`): it reads the score's sounding notes,
   chord symbols, bars, keys and `% section` labels (a tuplet's notes at their scaled lengths, as its parser
   `abc_tools.py` reads them), moves every Vocal note to Ins, where the vocal note wins (an
   Ins note it overlaps keeps only its parts outside it), and writes a fresh score from those events with its own
   serializer (`compile_events`): Vocal holds only the current chord symbol at every bar start and each chord change,
   over rests; Ins the notes, spelled against the bar's key; bars are grouped four to a line where meter, key and
   section stay the same; a section label is written where the section changes; the unit length is L:1/32 unless
   the events need a finer one (a tuplet is written as plain notes; one that lands off the power-of-two grid is
   refused),
4. renders the edited score as an external score with the style `instrumental_style(style)`, the lyrics
   `lyric_tags(score)` (its `% section` labels as `[Section]` tags, never sung words; none when it has no label) and
   the cot the score allows (`full` when Vocal keeps chord symbols, else `melody`), with the same seed.

This module is our own implementation of those rules (read from upstream's scripts, not copied; the parser,
`score.read_score`, follows `skills/yue2-music/scripts/abc_tools.py` at commit fcb5b96, the one with tuplets):
`edit_score` writes byte for byte the score upstream's `convert_score` writes, and refuses what upstream's parser,
editor and request check refuse, naming the score line and the reason. It is pure: no model, no files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from fractions import Fraction
from math import lcm
from typing import Callable

from .score import (FINEST_UNIT, NATURAL, SECTIONS, Score, ScoreError, Voice, _fail, _power_of_two, key_alterations,
                    meter_text, read_score, sized, split_length, write_score)

PLANNING_LYRICS = "[Intro]\n\n[Verse]\n\n[Chorus]\n\n[Outro]\n"  # upstream's planning lyrics: tags, no words
PLANNING_COT = "full"  # upstream plans with a chord-annotated score
NO_SINGING = ("no vocals", "no singing", "no choir", "no spoken words")  # upstream's style conditions, in order
BASE_UNIT = 32  # the edited score's L:1/N: 32 unless its events need finer, never past FINEST_UNIT
_MARKS = {0: "=", -1: "_", 1: "^"}
RECIPE = ("upstream examples/instrumental_clip.py: plan (cot full, PLANNING_LYRICS), "
          "convert_score(overlap='vocal', keep_chords=True), render with instrumental_style and lyric_tags")


# --------------------------------------------------------------------------- writing the edited score


@dataclass(frozen=True)
class _Bar:
    start: Fraction
    end: Fraction
    meter: tuple[int, int]
    key: str
    section: str | None
    line: int  # the Vocal music line it was read from


def _rests(length: Fraction, step: Fraction) -> list[str]:
    return [sized("z", count) for count in split_length(length / step)]


def _spell(pitch: int, key: str, marks: dict[str, int]) -> str:
    """Upstream's spelling: the letter whose alteration (-1, 0, +1) best fits the key (the key's own alteration
    first, then the smallest, then sharps in sharp keys and C, flats in flat keys); an accidental only where the key
    or the bar's earlier accidentals on that letter do not already give it."""
    signature = key_alterations(key, 0)
    sharp_side = sum(signature.values()) >= 0
    letter, alteration = min(((letter, alteration) for letter in NATURAL for alteration in (-1, 0, 1)
                              if (pitch - alteration - NATURAL[letter]) % 12 == 0),
                             key=lambda c: (c[1] != signature[c[0]], abs(c[1]), c[1] < 0 if sharp_side else c[1] > 0))
    mark = ""
    if alteration != marks.get(letter, signature[letter]):
        mark, marks[letter] = _MARKS[alteration], alteration
    octave = (pitch - alteration - 60 - NATURAL[letter]) // 12
    name = letter + "," * -octave if octave <= 0 else letter.lower() + "'" * (octave - 1)
    return mark + name


def _ins_bar(bar: _Bar, notes: list, step: Fraction) -> str:
    inside = [n for n in notes if n[0] < bar.end and n[0] + n[2] > bar.start]
    if not inside:
        return "Z"
    text, cursor, marks = [], bar.start, {}
    for onset, pitch, duration in inside:
        a, b = max(bar.start, onset), min(bar.end, onset + duration)
        if a > cursor:
            text += _rests(a - cursor, step)
        parts = split_length((b - a) / step)
        for index, count in enumerate(parts):
            tie = "-" if index < len(parts) - 1 or b < onset + duration else ""
            text.append(sized(_spell(pitch, bar.key, marks), count) + tie)
        cursor = b
    if cursor < bar.end:
        text += _rests(bar.end - cursor, step)
    return "".join(text)


def _vocal_bar(bar: _Bar, chords: list, step: Fraction) -> str:
    """Rests under the chord in force at the bar's start (repeated at every bar) and each change inside the bar."""
    current = next((symbol for when, symbol in reversed(chords) if when <= bar.start), None)
    changes = [(bar.start, current)] + [(when, symbol) for when, symbol in chords if bar.start < when < bar.end]
    if not any(symbol for _, symbol in changes):
        return "Z"
    text = []
    for index, (when, symbol) in enumerate(changes):
        stop = changes[index + 1][0] if index + 1 < len(changes) else bar.end
        text += ([f'"{symbol}"'] if symbol else []) + _rests(stop - when, step)
    return "".join(text)


def _write(bars: list[_Bar], notes: list, chords: list, bpm: int, unit: int) -> str:
    step = Fraction(4, unit)  # quarter notes per unit
    texts = {"Vocal": [_vocal_bar(bar, chords, step) for bar in bars],
             "Ins": [_ins_bar(bar, notes, step) for bar in bars]}
    return write_score(bars, texts, bpm, unit)


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


def _section_starts(score: Score) -> dict[Fraction, str]:
    """Each label's bar start: a `% label` line (the last of a stack) names the next Vocal music line's first bar."""
    vocal, pending, starts = score.voices["Vocal"], None, {}
    for number, line in enumerate(score.lines, start=1):
        if line.startswith("% "):
            pending = line[2:]
            if pending not in SECTIONS:
                raise _fail(number, f"unknown section label {pending!r}; upstream's recipe takes only its native "
                                    f"labels {list(SECTIONS)}")
        elif score.music_lines.get(number) == "Vocal" and pending is not None:
            starts[vocal.bars[vocal.bar_lines.index(number)][0]] = pending
            pending = None
    return starts


def _event_bars(score: Score) -> list[_Bar]:
    """Each bar's span, meter, key and section (a label holds until the next), as upstream hands them to its
    serializer; a key change inside a bar is refused."""
    vocal, section = score.voices["Vocal"], None
    sections = _section_starts(score)
    starts = {start for start, _, _ in vocal.bars}
    for (when, key), line in zip(vocal.keys, vocal.key_lines):
        if when not in starts:
            raise _fail(line, f"a key change inside a bar (K:{key}); upstream's recipe takes key changes at bar "
                              "starts only")
    bars = []
    for (start, length, meter), line in zip(vocal.bars, vocal.bar_lines):
        section = sections.get(start, section)
        key = next(key for when, key in reversed(vocal.keys) if when <= start)
        bars.append(_Bar(start, start + length, meter, key, section, line))
    return bars


def _chords(vocal: Voice) -> list:
    chords = []
    for (when, symbol), (line, _) in zip(vocal.chords, vocal.chord_places):
        if chords and chords[-1][0] == when:
            if chords[-1][1] != symbol:
                raise _fail(line, f"two different chord symbols at the same time ({chords[-1][1]!r}, {symbol!r})")
            continue
        chords.append((when, symbol))
    return chords


def _on_grid(quarters: Fraction) -> bool:
    return _power_of_two((quarters / 4).denominator)


def _refuse_off_grid(vocal: Voice, kept_ins: list) -> None:
    """Refuse the first event whose onset or length no L:1/N (N a power of two up to FINEST_UNIT) writes (only a
    tuplet makes one): Vocal's notes and chords first, in time order, then the kept Ins pieces `(onset, length,
    line, where)`; an off-grid Ins piece is its Ins note's own, or cut by an off-grid vocal note, named first."""
    vocal_events = sorted([(t, d, line, f"{where}: a note") for (t, _, d), (line, where) in
                           zip(vocal.notes, vocal.note_places)]
                          + [(t, None, line, f"{where}: a chord symbol {symbol!r}") for (t, symbol), (line, where) in
                             zip(vocal.chords, vocal.chord_places)], key=lambda event: (event[0], event[2]))
    events = vocal_events + [(t, d, line, f"{where}: a note") for t, d, line, where in sorted(kept_ins)]
    for onset, length, line, what in events:
        if not _on_grid(onset) or (length is not None and not _on_grid(length)):
            lasting = f" lasting {length} quarter notes" if length is not None else ""
            raise _fail(line, f"{what} at quarter {onset}{lasting} is off the power-of-two grid (no L:1/N with N "
                              f"a power of two up to {FINEST_UNIT} writes it); upstream's recipe refuses a rhythm "
                              "outside its training grid: quantize the tuplet")


def _unit(bars: list[_Bar], notes: list, chords: list) -> int:
    """Upstream's unit: L:1/32, made finer until every meter's beat quarter and every onset and length fits (the
    events are on the grid: `_refuse_off_grid`)."""
    unit = BASE_UNIT
    for bar in bars:
        unit = lcm(unit, 4 * bar.meter[1])
        if unit > FINEST_UNIT:
            raise _fail(bar.line, f"meter {meter_text(bar.meter)} needs a unit finer than L:1/{FINEST_UNIT}, "
                                  "outside upstream's power-of-two grid")
    for value in [t for t, _, _ in notes] + [d for _, _, d in notes] + [t for t, _ in chords]:
        unit = lcm(unit, (value / 4).denominator)
    return unit


def _harmony(chords: list) -> list:
    """The chord changes, a symbol repeated at a bar start dropped."""
    return [c for i, c in enumerate(chords) if i == 0 or chords[i - 1][1] != c[1]]


def edit_score(text: str) -> ScoreEdit:
    """Upstream's instrumental edit of a native score (its `convert_score(overlap="vocal", keep_chords=True)`): the
    score upstream writes, byte for byte, or a ScoreError naming the line and the reason upstream refuses it."""
    score = read_score(text)
    vocal, ins = score.voices["Vocal"], score.voices["Ins"]
    if not vocal.notes and not ins.notes:
        raise _fail(min(score.music_lines), "the score has no sounding notes (Vocal and Ins hold only rests)")
    occupied = [(t, t + d) for t, _, d in vocal.notes]
    merged = [list(n) for n in vocal.notes]
    trimmed, unchanged, kept_ins = [], 0, []
    for index, (start, pitch, duration) in enumerate(ins.notes):
        pieces = _outside(start, duration, occupied)
        if pieces == [(start, start + duration)]:
            unchanged += 1
        else:
            trimmed.append({"ins_note": index, "onset": str(start), "pitch": pitch, "duration": str(duration),
                            "kept": [[str(a), str(b - a)] for a, b in pieces]})
        merged.extend([a, pitch, b - a] for a, b in pieces)
        kept_ins += [(a, b - a, *ins.note_places[index]) for a, b in pieces]
    merged.sort()
    bars = _event_bars(score)
    chords = _chords(vocal)
    _refuse_off_grid(vocal, kept_ins)
    unit = _unit(bars, merged, chords)
    edited = _write(bars, merged, chords, score.bpm, unit)
    check = read_score(edited)  # upstream reads its output back: the same notes, harmony, grid and tempo
    if check.voices["Ins"].notes != merged or check.voices["Vocal"].notes or check.bpm != score.bpm \
            or _harmony(check.voices["Vocal"].chords) != _harmony(vocal.chords) \
            or check.voices["Ins"].bars != ins.bars:
        raise _fail(len(score.lines), "the edit could not write the moved notes back exactly (please report it "
                                      "with the score)")
    changes = {
        "recipe": RECIPE,
        "vocal_notes_moved_to_ins": len(vocal.notes),
        "ins_notes_before": len(ins.notes), "ins_notes_unchanged": unchanged, "ins_notes_after": len(merged),
        "ins_notes_trimmed_under_vocal": trimmed,
        "chords_kept_in_vocal": len(chords),
        "render_cot": "full" if chords else "melody",
        "sections": [line[2:] for line in check.lines if line.startswith("% ")],
        "unit_length": {"planned": str(score.unit), "edited": str(check.unit)},
        "line_endings": "crlf read as lf" if score.crlf else "lf",
        "bpm": score.bpm, "nominal_seconds": float(ins.time * 60 / score.bpm),
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
    """Upstream's render lyrics: the score's `% section` labels as `[Section]` tags (none: ''), never sung words."""
    labels = [line[2:] for line in text.splitlines() if line.startswith("% ")]
    return "\n\n".join(f"[{label.title()}]" for label in labels) + ("\n" if labels else "")


# --------------------------------------------------------------------------- requests


def planning_request(request):
    """The request that plans the score: the style as given, the given lyrics (upstream's PLANNING_LYRICS when none)
    and the request's cot (upstream's is full), seed and id."""
    lyrics = request.lyrics if request.lyrics.strip() else PLANNING_LYRICS
    return replace(request, lyrics=lyrics, instrumental=False, abc=None)


def render_request(request, edit: ScoreEdit):
    """The request that renders the edited score, as upstream's example builds it and its `validate_request`
    accepts it: the instrumental style, the score's section tags ('' when it has none), the cot the score allows,
    the same seed."""
    return replace(request, style=instrumental_style(request.style), lyrics=lyric_tags(edit.text), abc=edit.text,
                   cot=edit.cot, instrumental=False)


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


def plan_files(steps) -> dict[str, bytes]:
    """The plan stage's extra files of an instrumental song: instrumental.json (the steps; for upstream's recipe what
    the edit changed) and, for upstream's recipe, the planned score (as planned or given) as planned.abc; score.abc
    holds the rendered score."""
    from .checkpoint import json_text

    files = {"instrumental.json": (json_text(steps.record(), indent=2) + "\n").encode("utf-8")}
    if isinstance(steps, InstrumentalSteps):
        files["planned.abc"] = steps.planned.encode("utf-8")
    return files


# --------------------------------------------------------------------------- with an instrumental adapter

# The instrumental AR adapter's card (https://huggingface.co/Mothersuperior/YuE2-instrumental-cot-full-loras): run
# it with cot "full", a normal YuE2 tag string as the style, and lyrics that carry only the structure, "bare tag
# names: intro, verse, pre-chorus, chorus, bridge, outro. One tag per line".
ADAPTER_RECIPE = ("the instrumental adapter's card (Mothersuperior/YuE2-instrumental-cot-full-loras): one pass with the "
                  "adapter, cot full, the style as given, lyrics of bare section tags one per line")
ADAPTER_SECTIONS = ("intro", "verse", "pre-chorus", "chorus", "bridge", "outro")
ADAPTER_LYRICS = "[intro]\n[verse]\n[chorus]\n[outro]\n"  # the structure when the request gives none


def section_lyrics(lyrics: str) -> str:
    """The request's section tags as the card asks for them (`[verse]`, one per line, in order; numbered or cased
    tags as their bare name; words dropped), else ADAPTER_LYRICS."""
    tags = []
    for match in re.finditer(r"^\s*\[([^\]\n]+)\]", lyrics, re.M):
        name = re.sub(r"[\s_]*\d+$", "", match.group(1).strip().lower()).replace(" ", "-")
        if name in ADAPTER_SECTIONS:
            tags.append(f"[{name}]")
    return "\n".join(tags) + "\n" if tags else ADAPTER_LYRICS


@dataclass(frozen=True)
class AdapterSteps:
    """An instrumental song rendered with the instrumental adapter in one pass, as its card prescribes;
    `record()` is instrumental.json."""

    adapter: object  # protocol.AdapterRef
    render: object  # SongRequest

    def record(self) -> dict:
        return {"recipe": ADAPTER_RECIPE, "adapter": {"name": self.adapter.name, "scale": self.adapter.scale},
                "render_request": self.render.to_dict()}


def adapter_steps(request, adapter) -> AdapterSteps:
    """The one-pass recipe with the instrumental adapter (`adapter`: an AdapterRef) for a request without a given
    score: the request's style, its section tags as lyrics, cot full, the adapter added to the song's own."""
    adapters = request.adapters if any(ref.name == adapter.name for ref in request.adapters) \
        else (*request.adapters, adapter)
    render = replace(request, lyrics=section_lyrics(request.lyrics), cot="full", instrumental=False,
                     adapters=adapters)
    return AdapterSteps(adapter, render)


def rendered_request(meta: dict, request):
    """The request a planned stage renders: an instrumental song's render request, else the song's own."""
    record = meta.get("instrumental")
    return type(request).from_dict(record["render_request"]) if record else request
