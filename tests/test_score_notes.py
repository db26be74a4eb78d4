"""A native score's music as the upstream-exact reader reads it (yue2_vllm/score_notes.py): notes, chords and their
voicing, meters, keys and sections at their onsets, the cot the score renders with, and the reader's verdict in one
line naming the score line."""
from fractions import Fraction

import pytest

from yue2_vllm import score
from yue2_vllm.midi import midi_file
from yue2_vllm.score_notes import (CHORD_INTERVALS, MIDI_BPM_RANGE, Chord, Note, ScoreError, check_score, chord_pitches,
                                   problem_line, score_notes)

from test_instrumental import CASES, SCORE, header

F = Fraction


def test_the_notes_chords_and_sections_of_a_score():
    music = score_notes(SCORE)
    # Vocal: a rest, B (key of G) and the tied d (3 quarters), then ^c and =c; Ins: the intro's notes, the verse's
    assert music.voices["Vocal"] == (Note(F(9), F(1), 71), Note(F(10), F(3), 74), Note(F(13), F(1), 73),
                                     Note(F(14), F(2), 72))
    assert music.voices["Ins"] == (Note(F(0), F(1), 71), Note(F(1), F(1), 74), Note(F(2), F(2), 79),
                                   Note(F(4), F(4), 76), Note(F(8), F(2), 67), Note(F(10), F(2), 69),
                                   Note(F(12), F(4), 71))
    # each symbol holds until the next (the verse's "G" again at bar 3), the last to the score's end
    assert music.chords == (Chord(F(0), F(8), "G", (43, 55, 59, 62)), Chord(F(8), F(4), "G", (43, 55, 59, 62)),
                            Chord(F(12), F(4), "C", (36, 48, 52, 55)))
    assert (music.bpm, music.unit, music.bars, music.quarters) == (100, F(1, 32), 4, F(16))
    assert music.meters == ((F(0), (4, 4)),) and music.keys == ((F(0), "G"),)
    assert music.sections == ((F(0), "intro"), (F(8), "verse"))
    assert music.cot == "full" and music.seconds_per_quarter == F(3, 5)
    assert score_notes(SCORE.replace("\n", "\r\n")) == music


def test_meter_and_key_changes_and_a_score_without_chords():
    source = CASES["key and meter changes"][0]
    music = score_notes(source)
    assert music.meters == ((F(0), (4, 4)), (F(8), (3, 4)), (F(11), (6, 8)))
    assert music.keys == ((F(0), "D"), (F(4), "Bb"))  # the redundant K:Bb of the chorus is no change
    assert music.sections == ((F(0), "verse"), (F(4), "verse"), (F(8), "chorus"), (F(11), "chorus"))
    assert music.voices["Vocal"] == (Note(F(0), F(2), 66), Note(F(2), F(2), 73), Note(F(4), F(2), 70),
                                     Note(F(6), F(2), 75), Note(F(8), F(3), 74), Note(F(11), F(3), 70))
    assert music.voices["Ins"] == () and music.chords == () and music.cot == "melody"
    assert music.quarters == 14 and music.bars == 4


def test_a_triplet_and_stacked_labels():
    text = header("C", unit=8) + '% intro\n% verse\nV: Vocal\n"Am7"(3CDE z2 "G/B"G4|\nV: Ins\nZ|\n'
    music = score_notes(text)
    assert [n.onset for n in music.voices["Vocal"]] == [F(0), F(1, 3), F(2, 3), F(2)]
    assert [n.duration for n in music.voices["Vocal"]] == [F(1, 3), F(1, 3), F(1, 3), F(2)]
    assert music.chords == (Chord(F(0), F(2), "Am7", (45, 57, 60, 64, 67)), Chord(F(2), F(2), "G/B", (47, 55, 59, 62)))
    assert music.sections == ((F(0), "verse"),)  # of a stack of labels, the last names the group


def test_chord_voicings():
    assert chord_pitches("C") == (36, 48, 52, 55)
    assert chord_pitches("F#m7b5") == (42, 54, 57, 60, 64)
    assert chord_pitches("Bbmaj7/D") == (38, 58, 62, 65, 69)  # the slash note is the bass
    assert chord_pitches("Cb") == (47, 59, 63, 66)  # Cb's root is B
    assert chord_pitches("Gm(maj7)") == (43, 55, 58, 62, 66)
    # every quality the reader takes has its intervals, and no other
    assert set(CHORD_INTERVALS) == set(score._QUALITIES)
    for quality in score._QUALITIES:
        assert chord_pitches("E" + quality)[1] == 52
    with pytest.raises(ValueError, match="not a chord symbol of the native dialect: 'Gsus9'"):
        chord_pitches("Gsus9")


def test_the_verdict_is_the_music_or_one_line_naming_the_score_line():
    answer = check_score(SCORE)
    assert answer == {"valid": True, "problem": None, "line": None, "score": score_notes(SCORE).to_json()}
    music = answer["score"]
    assert (music["cot"], music["bpm"], music["unit"], music["meter"], music["key"], music["bars"]) == \
        ("full", 100, "1/32", "4/4", "G", 4)
    assert (music["quarters"], music["seconds"]) == (16.0, 9.6)
    assert music["voices"]["Vocal"][1] == {"onset": 10.0, "duration": 3.0, "pitch": 74}
    assert music["chords"][2] == {"onset": 12.0, "duration": 4.0, "symbol": "C", "pitches": [36, 48, 52, 55]}
    assert music["sections"] == [{"onset": 0.0, "label": "intro"}, {"onset": 8.0, "label": "verse"}]
    assert music["meters"] == [{"onset": 0.0, "meter": "4/4"}] and music["keys"] == [{"onset": 0.0, "key": "G"}]

    broken = SCORE.replace("B8d8g16|", "B8d8g8|")
    assert check_score(broken) == {
        "valid": False, "line": 13, "score": None,
        "problem": "score line 13: group 1, Ins, bar 1: the bar holds 3 quarter notes, its meter 4/4 takes 4"}
    for text, line in (("", 1), ("bkdlaazrckv fo", 1), (SCORE.replace("K:G", "K:H"), 8)):
        verdict = check_score(text)
        assert verdict["valid"] is False and verdict["line"] == line and "\n" not in verdict["problem"], verdict
        assert verdict["problem"].startswith(f"score line {line}: ")
    with pytest.raises(ScoreError) as caught:
        score_notes(broken)
    assert problem_line(caught.value) == 13


def test_a_tempo_midi_cannot_store_is_refused_naming_the_tempo_line():
    """MIDI keeps a quarter note's microseconds in 24 bits: a score past that reads, but its score.mid could not be
    written, so the verdict refuses it in one line naming Q: (line 5); the range is the MIDI writer's own."""
    def at(bpm):
        return SCORE.replace("Q:1/4=100", f"Q:1/4={bpm}")

    slowest, fastest = MIDI_BPM_RANGE
    for bpm in (slowest, fastest):
        assert check_score(at(bpm))["valid"] and midi_file(score_notes(at(bpm)))
    for bpm, words in ((slowest - 1, "slower"), (fastest + 1, "faster")):
        with pytest.raises(ValueError, match="^MIDI cannot write the tempo"):
            midi_file(score_notes(at(bpm)))
        verdict = check_score(at(bpm))
        assert verdict == {"valid": False, "line": 5, "score": None, "problem": (
            f"score line 5: the tempo Q:1/4={bpm} is {words} than a MIDI file can hold (Q:1/4={slowest} to "
            f"Q:1/4={fastest}: a quarter note of 1 to 16777215 microseconds)")}, verdict
