"""The native score's floor module: upstream's strip-chords and the section labels (the reader itself is pinned by
tests/test_instrumental.py, unchanged since it moved here)."""
import pytest

from yue2_vllm import instrumental, score
from yue2_vllm.score import ScoreError, read_score, section_labels, strip_chords

HEADER = ('X:1\nT:\nM:4/4\nL:1/16\nQ:1/4=96\nV: Vocal clef=treble name="Vocal Melody" snm="Vocal"\n'
          'V: Ins clef=treble name="Ins Melody" snm="Inst."\nK:D\n')
# Shaped as SheetSage2 writes a full score: chords in Vocal (over rests and notes, changing inside a bar), both
# melodies, an inline key change, a tie across the barline, accidentals, whole-bar rests.
FULL = HEADER + ('% intro\nV: Vocal\n"D"z16|"A"z16|\nV: Ins\nz8A4B4|^c4d4e8|\n'
                 '% verse\nV: Vocal\n"D"z4F4A4d4-|"G"d8"A7"c4A4|"Bm"B4[K:G]F4=F8|Z|\nV: Ins\nZ2|z4[K:G]z12|A,16|\n')


def test_strip_chords_removes_every_chord_symbol_and_nothing_else():
    stripped = strip_chords(FULL)
    assert stripped == FULL.replace('"D"', "").replace('"A"', "").replace('"G"', "").replace('"A7"', "") \
        .replace('"Bm"', "")
    before, after = read_score(FULL), read_score(stripped)
    for name in ("Vocal", "Ins"):
        assert after.voices[name].notes == before.voices[name].notes and after.voices[name].chords == []


def test_keeping_one_voice_turns_the_others_notes_into_rests_of_their_length():
    assert strip_chords(FULL, keep_voice="Vocal") == HEADER + (
        '% intro\nV: Vocal\nz16|z16|\nV: Ins\nz8z4z4|z4z4z8|\n'
        '% verse\nV: Vocal\nz4F4A4d4-|d8c4A4|B4[K:G]F4=F8|Z|\nV: Ins\nZ2|z4[K:G]z12|z16|\n')
    kept = read_score(strip_chords(FULL, keep_voice="Ins"))
    assert kept.voices["Vocal"].notes == [] and kept.voices["Ins"].notes == read_score(FULL).voices["Ins"].notes


def test_a_score_without_chords_comes_back_as_it_was():
    plain = strip_chords(FULL)
    assert strip_chords(plain) == plain


def test_strip_chords_refuses_what_the_reader_refuses_and_an_unknown_voice():
    with pytest.raises(ScoreError, match="score line 13: group 1, Ins, bar 1: an event after the end of the bar"):
        strip_chords(FULL.replace("z8A4B4|", "z8A4B4C|"))
    with pytest.raises(ValueError, match="keep_voice"):
        strip_chords(FULL, keep_voice="vocal")


def test_instrumental_reads_with_the_same_reader():
    assert instrumental.read_score is score.read_score and instrumental.ScoreError is score.ScoreError


def test_section_labels_name_the_bar_their_group_starts_with_stripped_as_a_name():
    assert section_labels(read_score(FULL)) == ((0, "intro"), (2, "verse"))
    # a hand-edited label: the name without the blanks around it; of a stack of labels, the last
    edited = FULL.replace("% intro\n", "%  intro \n").replace("% verse\n", "% bridge\n%   verse\t\n")
    assert section_labels(read_score(edited)) == ((0, "intro"), (2, "verse"))
