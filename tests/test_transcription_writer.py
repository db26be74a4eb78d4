"""The melody-mode writer: exact scores for known melodies (spelling, ties, Z runs, groups, sections, the other
voice), and every score it writes read back by upstream's reader as the notes it was given (hypothesis)."""
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from yue2_vllm.score import KEYS, SECTIONS, read_score
from yue2_vllm.transcription.writer import melody_score, spell, written_sections

VOCAL = 'V: Vocal clef=treble name="Vocal Melody" snm="Vocal"\nV: Ins clef=treble name="Ins Melody" snm="Inst."\n'


def header(key="C", meter="4/4", unit=16, bpm=100):
    return f"X:1\nT:\nM:{meter}\nL:1/{unit}\nQ:1/4={bpm}\n{VOCAL}K:{key}\n"


def test_a_simple_melody_in_vocal_with_whole_bar_rests_in_ins():
    notes = [(0, 4, 60), (4, 4, 62), (8, 8, 64), (16, 16, 65)]
    assert melody_score(notes, meter=(4, 4), key="C", bpm=100) == header() + \
        "V: Vocal\nC4D4E8|F16|\nV: Ins\nZ2|\n"


def test_ins_takes_the_melody_when_asked():
    assert melody_score([(0, 16, 72)], meter=(4, 4), key="C", bpm=90, voice="Ins") == header(bpm=90) + \
        "V: Vocal\nZ|\nV: Ins\nc16|\n"


def test_notes_are_cut_at_barlines_and_tied_and_lengths_are_the_dialects():
    # A pickup rest, a note of 5 units (4 tied to 1), one of 22 across the barline (6 + 1 | 12 + 3), rests split
    # longest first around a note of one unit.
    notes = [(4, 5, 67), (9, 22, 72), (40, 1, 71)]
    assert melody_score(notes, meter=(4, 4), key="C", bpm=100) == header() + \
        "V: Vocal\nz4G4-Gc6-c-|c12-c3z|z8Bz6z|\nV: Ins\nZ3|\n"


def test_accidentals_are_key_relative_carry_by_letter_in_a_bar_and_return_after_the_barline():
    # C#, C# again (carried), C natural (marked), B flat; then C# again in the next bar.
    notes = [(0, 4, 61), (4, 4, 73), (8, 4, 60), (12, 4, 70), (16, 16, 61)]
    assert melody_score(notes, meter=(4, 4), key="C", bpm=100) == header() + \
        "V: Vocal\n^C4c4=C4_B4|^C16|\nV: Ins\nZ2|\n"


def test_a_tied_piece_repeats_its_accidental_inside_the_bar_and_after_the_barline():
    notes = [(0, 20, 66), (20, 12, 65)]  # F# for 20 units in C (16 + 4 tied), then F natural
    assert melody_score(notes, meter=(4, 4), key="C", bpm=100) == header() + \
        "V: Vocal\n^F16-|^F4=F12|\nV: Ins\nZ2|\n"


@pytest.mark.parametrize("key, pitches, written", [
    ("C", range(60, 72), ["C", "^C", "D", "^D", "E", "F", "^F", "G", "^G", "A", "_B", "B"]),
    ("G", range(60, 72), ["C", "^C", "D", "^D", "E", "=F", "F", "G", "^G", "A", "^A", "B"]),
    ("D", range(60, 72), ["=C", "C", "D", "^D", "E", "^E", "F", "G", "^G", "A", "^A", "B"]),
    ("F", range(60, 72), ["C", "^C", "D", "_E", "E", "F", "^F", "G", "^G", "A", "B", "=B"]),
    ("Am", range(57, 69), ["A,", "_B,", "B,", "C", "^C", "D", "^D", "E", "F", "^F", "G", "^G"]),
    ("C#", [62, 72, 71], ["^^C", "B", "=B"]),  # C## (D), B# (C5: written B4), B natural
    ("Cb", [69, 71, 59, 64], ["__B", "c", "C", "F"]),  # Bbb (A), Cb5 (B4), Cb4 (B3), Fb (E)
])
def test_pitches_are_spelled_as_sheetsage2_spells_them(key, pitches, written):
    assert [spell(pitch, key, {}) for pitch in pitches] == written


def test_octaves_are_written_with_case_and_marks():
    assert [spell(pitch, "C", {}) for pitch in (36, 48, 60, 72, 84, 96)] == ["C,,", "C,", "C", "c", "c'", "c''"]


def test_groups_hold_four_bars_and_break_where_a_section_starts():
    notes = [(16 * bar, 16, 60 + bar) for bar in (0, 3, 4, 6)]
    text = melody_score(notes, meter=(4, 4), key="C", bpm=100, sections={0: "verse", 6: "chorus"})
    assert text == header() + (
        "% verse\nV: Vocal\nC16|Z2|^D16|\nV: Ins\nZ4|\n"
        "V: Vocal\nE16|Z|\nV: Ins\nZ2|\n"
        "% chorus\nV: Vocal\n^F16|\nV: Ins\nZ|\n")
    assert written_sections({0: "verse", 6: "chorus"}) == ((1, "verse"), (7, "chorus"))


def test_a_section_repeated_at_once_is_labelled_once_as_sheetsage2_does():
    notes = [(0, 16, 60), (16, 16, 62)]
    text = melody_score(notes, meter=(4, 4), key="C", bpm=100, sections={0: "verse", 1: "verse"})
    assert text.count("% verse") == 1 and written_sections({0: "verse", 1: "verse"}) == ((1, "verse"),)


def test_six_eight_is_written_on_a_thirty_second_grid():
    # Two dotted quarters a bar: 12 units each at L:1/32.
    notes = [(0, 12, 67), (12, 12, 64), (24, 24, 60)]
    assert melody_score(notes, meter=(6, 8), key="C", bpm=120) == header(meter="6/8", unit=32, bpm=120) + \
        "V: Vocal\nG12E12|C24|\nV: Ins\nZ2|\n"


METERS = [(4, 4), (3, 4), (2, 4), (5, 4), (6, 8), (2, 2), (7, 8)]


@st.composite
def melodies(draw):
    meter = draw(st.sampled_from(METERS))
    position, notes = draw(st.integers(0, 8)), []
    for _ in range(draw(st.integers(1, 40))):
        length = draw(st.integers(1, 70))
        notes.append((position, length, draw(st.integers(21, 108))))
        position += length + draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4, 8, 17, 40]))
    bars = -(-position // (meter[0] * 4))
    sections = draw(st.dictionaries(st.integers(0, bars), st.sampled_from(SECTIONS), max_size=4))
    return notes, meter, draw(st.sampled_from(sorted(KEYS))), draw(st.sampled_from(["Vocal", "Ins"])), sections


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(melodies(), st.integers(30, 300))
def test_every_score_the_writer_writes_reads_back_as_its_notes(melody, bpm):
    notes, meter, key, voice, sections = melody
    text = melody_score(notes, meter=meter, key=key, bpm=bpm, voice=voice, sections=sections)
    score = read_score(text)
    step = Fraction(1, meter[1])  # quarter notes a step
    assert score.voices[voice].notes == [[p * step, pitch, n * step] for p, n, pitch in notes]
    other = score.voices["Ins" if voice == "Vocal" else "Vocal"]
    assert other.notes == [] and other.chords == [] and score.voices[voice].chords == []
    bars = -(-max(p + n for p, n, _ in notes) // (meter[0] * 4))
    assert len(score.voices["Vocal"].bars) == bars and score.bpm == bpm and score.unit == Fraction(1, 4 * meter[1])
    assert "w:" not in text and '"' not in text.split("K:", 1)[1]
    shown = [line[2:] for line in text.splitlines() if line.startswith("% ")]
    assert shown == [label for _, label in written_sections({b: s for b, s in sections.items() if b < bars})]
