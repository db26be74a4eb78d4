"""The lyrics' section tags as the score's `% section` labels, and their syllables against the notes.

YuE2 sings the lyrics' lines in order over the Vocal melody at about one syllable a note, each section's block
starting at its label. So a section starts at the note its syllables reach: the syllables before it, scaled from
the lyrics' count to the melody's notes, moved to the nearest phrase start (a note after a rest of a beat or more)
close by; its label goes on the bar that note is in. A tag is read as upstream's native labels (`score.SECTIONS`),
numbered or cased as people write them (`[Verse 2]`, `[Pre Chorus]`, `[Hook]`); any other tag writes no label (its
notes carry on the section before).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..score import SECTIONS
from .result import TranscriptionWarning

ALIASES = {"prechorus": "pre-chorus", "hook": "chorus", "refrain": "chorus", "inst": "instrumental",
           "solo": "instrumental", "break": "interlude"}
_TAG = re.compile(r"^\s*\[([^\]\n]+)\]\s*(.*)$")
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
_VOWELS = re.compile(r"[aeiouyàáâãäåæèéêëìíîïòóôõöøœùúûüýÿ]+", re.I)
# Scripts sung a syllable a character: CJK ideographs, kana, Hangul syllables.
_SYLLABIC = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
PHRASE_REST_STEPS = 4  # a rest of a beat or more starts a phrase
SYLLABLES_PER_NOTE = (0.8, 1.25)  # outside this, YuE2's one syllable a note will not fit the melody


@dataclass(frozen=True)
class LyricSection:
    tag: str  # as written, e.g. "Verse 2" ("" for words before the first tag)
    label: str | None  # upstream's native label, None where none fits
    syllables: int


def native_label(tag: str) -> str | None:
    name = re.sub(r"[\s_]*\d+$", "", tag.strip().lower())
    name = re.sub(r"[\s_]+", "-", name)
    name = ALIASES.get(name, name)
    return name if name in SECTIONS else None


def syllables(text: str) -> int:
    """Sung syllables of a line: a character of a syllabic script each, a vowel group of any other word (a silent
    final e not counted), at least one a word."""
    count = 0
    for word in _WORD.findall(text):
        syllabic = len(_SYLLABIC.findall(word))
        rest = _SYLLABIC.sub(" ", word)
        for part in rest.split():
            groups = len(_VOWELS.findall(part))
            if groups > 1 and part.lower().endswith("e") and not part.lower().endswith(("le", "ee")):
                groups -= 1
            count += max(1, groups)
        count += syllabic
    return count


def lyric_sections(lyrics: str) -> list[LyricSection]:
    """The lyrics' sections in order with their syllables (words before the first tag: a section with no tag)."""
    sections: list[LyricSection] = []
    tag, label, count = "", None, 0
    for line in lyrics.splitlines():
        match = _TAG.match(line)
        if match is None:
            count += syllables(line)
            continue
        if tag or count:
            sections.append(LyricSection(tag, label, count))
        tag, count = match.group(1).strip(), syllables(match.group(2))
        label = native_label(tag)
    if tag or count:
        sections.append(LyricSection(tag, label, count))
    return sections


def syllable_warning(sections: Sequence[LyricSection], notes: int) -> TranscriptionWarning | None:
    """A warning where the lyrics' syllables will not fit a melody of `notes` notes at about one a note."""
    total = sum(section.syllables for section in sections)
    if not total or not notes or SYLLABLES_PER_NOTE[0] <= total / notes <= SYLLABLES_PER_NOTE[1]:
        return None
    return TranscriptionWarning(
        "syllables", f"syllables: the lyrics have {total} syllables and the melody {notes} notes; YuE2 sings about "
                     "one syllable a note, so the words will crowd or run out (fit the lyrics to the melody)",
        {"syllables": total, "notes": notes, "per_note": round(total / notes, 3)})


def _phrase_start(index: int, positions: Sequence[int], lengths: Sequence[int], reach: int) -> int:
    """The phrase start nearest note `index` within `reach` notes (the earlier one on a tie), else `index`."""
    starts = [i for i in range(max(0, index - reach), min(len(positions), index + reach + 1))
              if i == 0 or positions[i] - positions[i - 1] - lengths[i - 1] >= PHRASE_REST_STEPS]
    return min(starts, key=lambda i: (abs(i - index), i)) if starts else index


def place_sections(lyrics: str, positions: Sequence[int], lengths: Sequence[int],
                   bar_steps: int) -> tuple[dict[int, str], list[TranscriptionWarning]]:
    """The labels by bar (0-based) for notes at `positions` lasting `lengths` (steps), and the warnings: tags that
    are no native label, sections with no words or no bar of their own, syllables that will not fit the notes."""
    sections = lyric_sections(lyrics)
    total, notes = sum(section.syllables for section in sections), len(positions)
    warnings, labels, owner = [warning for warning in [syllable_warning(sections, notes)] if warning], {}, {}
    unknown = [section.tag for section in sections if section.tag and section.label is None]
    if unknown:
        warnings.append(TranscriptionWarning(
            "section-labels", f"sections: {', '.join(f'[{tag}]' for tag in unknown)} "
                              f"{'is' if len(unknown) == 1 else 'are'} not among upstream's section labels "
                              f"({', '.join(SECTIONS)}); no label is written for "
                              f"{'it' if len(unknown) == 1 else 'them'}", {"tags": unknown}))
    if not total or not notes:
        if any(section.label for section in sections):
            warnings.append(TranscriptionWarning(
                "sections", "sections: the lyrics have no words to place their sections by; the first label "
                            "starts the score", {}))
            labels[0] = next(section.label for section in sections if section.label)
        return labels, warnings
    before, unplaced, last = 0, [], 0
    for section in sections:
        if section.label is not None:
            if not section.syllables:
                unplaced.append(section.tag)
            else:
                target = min(notes - 1, round(before * notes / total))
                reach = max(2, round(section.syllables * notes / total / 4))
                bar = last = max(last, positions[_phrase_start(target, positions, lengths, reach)] // bar_steps)
                if bar in owner:
                    unplaced.append(owner[bar])
                labels[bar], owner[bar] = section.label, section.tag
        before += section.syllables
    if unplaced:
        warnings.append(TranscriptionWarning(
            "sections", f"sections: {', '.join(f'[{tag}]' for tag in unplaced)} got no bar of its own (no words, or "
                        "too few notes before the next section); its label is not written", {"tags": unplaced}))
    return labels, warnings
