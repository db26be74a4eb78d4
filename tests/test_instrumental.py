"""The instrumental switch: upstream's score edit pinned on hand-written native scores, and songs end to end.

Every expected score below is the text upstream's recipe writes for its source: each was obtained by running
upstream's own scripts (`skills/yue2-music` instrumental `convert_score(overlap="vocal", keep_chords=True)`, then
its `validate_score`, `lyric_tags` and `validate_request` as `examples/instrumental_clip.py` calls them, with the
parser `skills/yue2-music/scripts/abc_tools.py` of commit fcb5b96, which reads tuplets) on the same source, and each
refused source is one upstream refuses too (docs/instrumental.md)."""
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from yue2_vllm.instrumental import (PLANNING_LYRICS, SECTIONS, ScoreError, edit_score, instrumental_style,
                                    lyric_tags, plan_steps, read_score, render_request)
from yue2_vllm.protocol import SongRequest
from yue2_vllm.request_json import UsageError, request_from_json
from yue2_vllm.options import AROptions, EngineOptions, LoadOptions


def header(key="G", unit=32, meter="4/4", bpm=100, extra_voice=""):
    return (f'X:1\nT:\nM:{meter}\nL:1/{unit}\nQ:1/4={bpm}\nV: Vocal clef=treble name="Vocal Melody" snm="Vocal"\n'
            f'V: Ins clef=treble name="Ins Melody" snm="Inst."\n{extra_voice}K:{key}\n')


HEADER = header()
# Two groups: an intro where only Ins plays (and Vocal holds a chord over rests), a verse where Vocal sings over Ins.
SCORE = HEADER + ('% intro\nV: Vocal\n"G"z32|Z|\nV: Ins\nB8d8g16|e32|\n'
                  '% verse\nV: Vocal\n"G"z8B8d16-|"C"d8^c8=c16|\nV: Ins\nG16A16|B32|\n')
# Upstream writes the chord in force at every bar start ("G" again over the intro's second bar).
EDITED = HEADER + ('% intro\nV: Vocal\n"G"z32|"G"z32|\nV: Ins\nB8d8g16|e32|\n'
                   '% verse\nV: Vocal\n"G"z32|"C"z32|\nV: Ins\nG8B8d16-|d8^c8=c16|\n')

# name: (source, the edited score upstream writes, its section tags, the render's cot)
CASES = {
    "chords at every bar start, an Ins note trimmed under the vocal": (SCORE, EDITED, "[Intro]\n\n[Verse]\n", "full"),
    "ties within a bar, across bars and into the next group": (
        header("C") + '% verse\nV: Vocal\nC16E16-|E32-|E8z24|\nV: Ins\nZ3|\n'
                      '% chorus\nV: Vocal\nG32-|\nV: Ins\nZ|\n% outro\nV: Vocal\nG16z16|\nV: Ins\nc32|\n',
        header("C") + '% verse\nV: Vocal\nZ3|\nV: Ins\nC16E16-|E32-|E8z24|\n'
                      '% chorus\nV: Vocal\nZ|\nV: Ins\nG32-|\n% outro\nV: Vocal\nZ|\nV: Ins\nG16c16|\n',
        "[Verse]\n\n[Chorus]\n\n[Outro]\n", "melody"),
    # In F: a natural B, B flat held to the bar's end, C# re-spelled Db; the next bar starts from the key; an F#
    # tied over the barline is marked again in the next bar (as Gb), the F after it is the key's.
    "accidentals held to the bar's end, re-spelled against the key": (
        header("F") + '% verse\nV: Vocal\n=B8_B8B8^c8|c8B8b8B8|^F32-|F16=F16|\nV: Ins\nZ4|\n',
        header("F") + '% verse\nV: Vocal\nZ4|\nV: Ins\n=B8_B8B8_d8|c8B8b8B8|_G32-|_G16F16|\n', "[Verse]\n", "melody"),
    "a flat key spells flats": (
        header("Eb") + '% verse\nV: Vocal\n=B8A8^F8G8|\nV: Ins\nZ|\n',
        header("Eb") + '% verse\nV: Vocal\nZ|\nV: Ins\n=B8A8_G8=G8|\n', "[Verse]\n", "melody"),
    "C# major spells C as B#": (
        header("C#") + '% verse\nV: Vocal\n=C8=E8=B8c8|\nV: Ins\nZ|\n',
        header("C#") + '% verse\nV: Vocal\nZ|\nV: Ins\nB,8=E8=B8^B8|\n', "[Verse]\n", "melody"),
    "octave marks": (
        header("C") + "% bridge\nV: Vocal\nC,,8c''8^G,8z8|Z|\nV: Ins\nZ|e32|\n",
        header("C") + "% bridge\nV: Vocal\nZ2|\nV: Ins\nC,,8c''8^G,8z8|e32|\n", "[Bridge]\n", "melody"),
    # A repeated label starts no new section: its bars join the verse's line; a redundant K: is dropped.
    "key and meter changes": (
        header("D") + '% verse\nV: Vocal\nF16c16|\nV: Ins\nZ|\n% verse\nV: Vocal\nK:Bb\nB16e16|\nV: Ins\nK:Bb\nZ|\n'
                      '% chorus\nV: Vocal\nM:3/4\nK:Bb\nd24|\nV: Ins\nM:3/4\nK:Bb\nZ|\n'
                      '% chorus\nV: Vocal\nM:6/8\nB24|\nV: Ins\nM:6/8\nZ|\n',
        header("D") + '% verse\nV: Vocal\nZ|\nV: Ins\nF16c16|\nV: Vocal\nK:Bb\nZ|\nV: Ins\nK:Bb\nB16e16|\n'
                      '% chorus\nV: Vocal\nM:3/4\nZ|\nV: Ins\nM:3/4\nd24|\nV: Vocal\nM:6/8\nZ|\nV: Ins\nM:6/8\nB24|\n',
        "[Verse]\n\n[Chorus]\n", "melody"),
    "a repeated label merges into one section, four bars to a line": (
        HEADER + '% verse\nV: Vocal\nG32|\nV: Ins\nZ|\n% verse\nV: Vocal\nA32|\nV: Ins\nZ|\n'
                 '% verse\nV: Vocal\nB32|B32|B32|B32|\nV: Ins\nZ4|\n',
        HEADER + '% verse\nV: Vocal\nZ4|\nV: Ins\nG32|A32|B32|B32|\nV: Vocal\nZ2|\nV: Ins\nB32|B32|\n',
        "[Verse]\n", "melody"),
    "stacked labels: the last one names the group": (
        HEADER + '% intro\n% verse\nV: Vocal\nG32|\nV: Ins\nZ|\n% chorus\nV: Vocal\nA32|\nV: Ins\nZ|\n',
        HEADER + '% verse\nV: Vocal\nZ|\nV: Ins\nG32|\n% chorus\nV: Vocal\nZ|\nV: Ins\nA32|\n',
        "[Verse]\n\n[Chorus]\n", "melody"),
    "no section label: no tags": (
        HEADER + 'V: Vocal\n"G"G32|\nV: Ins\nZ|\nV: Vocal\nA32|\nV: Ins\nB32|\n',
        HEADER + 'V: Vocal\n"G"z32|"G"z32|\nV: Ins\nG32|A32|\n', "", "full"),
    "native labels, title-cased in the tags": (
        HEADER + '% pre-chorus\nV: Vocal\nG32|\nV: Ins\nZ|\n% interlude\nV: Vocal\nZ|\nV: Ins\nA32|\n'
                 '% instrumental\nV: Vocal\nZ|\nV: Ins\nB32|\n',
        HEADER + '% pre-chorus\nV: Vocal\nZ|\nV: Ins\nG32|\n% interlude\nV: Vocal\nZ|\nV: Ins\nA32|\n'
                 '% instrumental\nV: Vocal\nZ|\nV: Ins\nB32|\n',
        "[Pre-Chorus]\n\n[Interlude]\n\n[Instrumental]\n", "melody"),
    "a coarse L:1/8 is written at upstream's L:1/32": (
        header(unit=8) + '% verse\nV: Vocal\n"G"G2A2B4|\nV: Ins\nD8|\n',
        HEADER + '% verse\nV: Vocal\n"G"z32|\nV: Ins\nG8A8B16|\n', "[Verse]\n", "full"),
    "a fine L:1/64 stays where the notes need it": (
        header(unit=64) + '% verse\nV: Vocal\nG1A3B12z48|\nV: Ins\nZ|\n',
        header(unit=64) + '% verse\nV: Vocal\nZ|\nV: Ins\nGA3B12z48|\n', "[Verse]\n", "melody"),
    "an inline key at a bar start becomes a K: line": (
        header("C") + '% verse\nV: Vocal\nF32|[K:D]F32|F32|\nV: Ins\nZ|[K:D]z32|Z|\n',
        header("C") + '% verse\nV: Vocal\nZ|\nV: Ins\nF32|\nV: Vocal\nK:D\nZ2|\nV: Ins\nK:D\nF32|F32|\n',
        "[Verse]\n", "melody"),
    "a chord change inside a bar, none before it": (
        HEADER + '% verse\nV: Vocal\nG16"C"A16|B32|\nV: Ins\nZ2|\n',
        HEADER + '% verse\nV: Vocal\nz16"C"z16|"C"z32|\nV: Ins\nG16A16|B32|\n', "[Verse]\n", "full"),
    "the same chord twice at one time is one chord": (
        HEADER + '% verse\nV: Vocal\n"G""G"G32|\nV: Ins\nZ|\n',
        HEADER + '% verse\nV: Vocal\n"G"z32|\nV: Ins\nG32|\n', "[Verse]\n", "full"),
    "the vocal note wins over the Ins note under it": (
        header("C") + '% verse\nV: Vocal\nz8E8z16|\nV: Ins\nC32|\n',
        header("C") + '% verse\nV: Vocal\nZ|\nV: Ins\nC8E8C16|\n', "[Verse]\n", "melody"),
    "an already-instrumental score is its own edit": (EDITED, EDITED, "[Intro]\n\n[Verse]\n", "full"),
    # Tuplets: upstream's parser scales the next r notes or rests by q/p; its serializer writes plain notes.
    # (3 of 12 units = 8 each; (3:2:2 scales two (the z16 after it is plain); (4 of 8 = 6 each, the vocal c over
    # the Ins F and G; a chord inside a triplet keeps its scaled time (beat 2 of bar 2: 8 units).
    "tuplets on the L:1/32 grid are written as plain notes": (
        HEADER + '% verse\nV: Vocal\n"G"(3B12d12g12z8|(3:2:2z12"C"c12z16|\nV: Ins\nZ|(4E8F8G8A8z8|\n',
        HEADER + '% verse\nV: Vocal\n"G"z32|"G"z8"C"z24|\nV: Ins\nB8d8g8z8|E6F2c8G2A6z8|\n', "[Verse]\n", "full"),
    "a duplet of single units needs L:1/64": (  # (2: two notes of 1 unit last 3/2 units each
        header("C") + '% chorus\nV: Vocal\n(2CDz24z4z|\nV: Ins\nZ|\n',
        header("C", unit=64) + '% chorus\nV: Vocal\nZ|\nV: Ins\nC3D3z48z8z2|\n', "[Chorus]\n", "melody"),
    "a duplet in 6/8: 9 units, tied as 8 and 1": (
        header(meter="6/8") + '% verse\nV: Vocal\n(2B6d6z6|\nV: Ins\nZ|\n',
        header(meter="6/8") + '% verse\nV: Vocal\nZ|\nV: Ins\nB8-Bd8-dz6|\n', "[Verse]\n", "melody"),
    "ties out of and into a triplet, over barlines": (
        HEADER + '% verse\nV: Vocal\nz8(3B12d12g12-|g32|\nV: Ins\nZ2|\nV: Vocal\nz16B16-|(3B12d12g12z8|\nV: Ins\nZ2|\n',
        HEADER + '% verse\nV: Vocal\nZ4|\nV: Ins\nz8B8d8g8-|g32|z16B16-|B8d8g8z8|\n', "[Verse]\n", "melody"),
    # (5 has no default ratio; (5:4 of five rests lands on the grid; a note tied through a triplet is one note.
    "a (5:4 of rests and a note tied through a triplet": (
        HEADER + '% verse\nV: Vocal\n(5:4z4z4z4z4z4B16|(3B6-B6-B6 d8z12|\nV: Ins\nZ2|\n',
        HEADER + '% verse\nV: Vocal\nZ2|\nV: Ins\nz16B16|B12d8z12|\n', "[Verse]\n", "melody"),
    # Upstream checks the grid on the notes it writes: an off-grid Ins triplet wholly under the vocal note is gone.
    "an off-grid Ins triplet under the vocal line is dropped, not refused": (
        HEADER + '% verse\nV: Vocal\nB32|\nV: Ins\n(3C8D8E8z16|\n',
        HEADER + '% verse\nV: Vocal\nZ|\nV: Ins\nB32|\n', "[Verse]\n", "melody"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_edit_writes_upstreams_bytes_and_tags(name):
    source, expected, tags, cot = CASES[name]
    edit = edit_score(source)
    assert edit.text == expected
    assert lyric_tags(edit.text) == tags and edit.cot == cot
    assert edit_score(expected).text == expected  # the edited score is a fixed point: a take or a resubmission
    assert edit_score(source.replace("\n", "\r\n")).text == expected  # CRLF reads as LF; upstream writes LF
    score = read_score(edit.text)
    assert score.voices["Vocal"].notes == [] and score.voices["Ins"].bars == read_score(source).voices["Ins"].bars


def test_what_the_edit_moved_and_kept():
    edit = edit_score(SCORE)
    score = read_score(edit.text)
    assert score.voices["Vocal"].chords == [(0, "G"), (4, "G"), (8, "G"), (12, "C")]
    # The verse's Ins G (beat 1-2) keeps the half before the vocal B enters; its A and B are under the vocal line.
    assert score.voices["Ins"].notes[4:] == [[8, 67, 1], [9, 71, 1], [10, 74, 3], [13, 73, 1], [14, 72, 2]]
    changes = edit.changes
    assert (changes["vocal_notes_moved_to_ins"], changes["ins_notes_before"], changes["ins_notes_unchanged"],
            changes["ins_notes_after"]) == (4, 7, 4, 9)
    assert [t["ins_note"] for t in changes["ins_notes_trimmed_under_vocal"]] == [4, 5, 6]
    assert changes["ins_notes_trimmed_under_vocal"][0]["kept"] == [["8", "1"]]
    assert changes["render_cot"] == "full" and changes["sections"] == ["intro", "verse"]
    assert changes["nominal_seconds"] == 9.6 and changes["line_endings"] == "lf"
    assert edit_score(SCORE.replace("\n", "\r\n")).changes["line_endings"] == "crlf read as lf"
    assert edit_score(CASES["a coarse L:1/8 is written at upstream's L:1/32"][0]).changes["unit_length"] == \
        {"planned": "1/8", "edited": "1/32"}


# What upstream refuses, refused here with the score line and the reason (each one upstream's reason, our words).
REFUSED = [
    (header(extra_voice='V: Piano clef=treble name="Piano"\n') + '% verse\nV: Vocal\nG32|\nV: Ins\nZ|\n', 8,
     "expected the key K: .*exactly the Vocal and Ins voices"),
    (SCORE.replace('V: Vocal clef=treble name="Vocal Melody" snm="Vocal"\n', ""), 6, "Vocal voice definition"),
    (SCORE.replace("V: Ins clef", "V: Piano clef"), 7, "Ins voice definition"),
    (SCORE.replace("T:\n", "T:Song\n"), 2, "a blank title"),
    (SCORE.replace("L:1/32", "L:1/12"), 4, "unsupported unit length L:1/12"),
    (SCORE.replace("Q:1/4=100", "Q:100"), 5, "the tempo Q:1/4=<BPM>"),
    (SCORE.replace("K:G", "K:H"), 8, "unsupported key 'H'"),
    (SCORE.replace("K:G", "K:Gmix"), 8, "unsupported key 'Gmix'"),
    (SCORE.replace("% intro\n", "%%MIDI program 0\n"), 9, "expected 'V: Vocal'"),
    (SCORE.replace("G16A16|B32|\n", "G16A16|B32|\nw: la la\n"), 19, "expected 'V: Vocal'"),
    (SCORE + "\n", 19, "expected 'V: Vocal', got ''"),  # a blank line after the last group
    (SCORE + "% outro\n", 19, "a section comment with no music after it"),
    (HEADER + "% verse\nV: Vocal\nG32|\n", 11, "ends after 11 lines"),
    (SCORE.replace("B8d8g16|", "B8d8g8|"), 13, "holds 3 quarter notes, its meter 4/4 takes 4"),
    (SCORE.replace("B8d8g16|", "B8d8g10z6|"), 13, "unsupported length 10"),
    (SCORE.replace("e32|\n", "e32\n"), 13, "must end with a plain barline"),
    (SCORE.replace("e32|\n", "e32||\n"), 13, "an empty bar or a double/repeat barline"),
    # tuplets upstream's parser refuses, and ones off the power-of-two grid its serializer writes
    (SCORE.replace("B8d8g16|", "(3B8d8g8z16|"), 13, "group 1, Ins, bar 1: a note at quarter 0 lasting 2/3 quarter "
     "notes is off the power-of-two grid .*quantize the tuplet"),
    (HEADER + '% verse\nV: Vocal\n(3z8"C"z8z8z16|\nV: Ins\nB32|\n', 11,
     "group 1, Vocal, bar 1: a chord symbol 'C' at quarter 2/3 is off the power-of-two grid"),
    (HEADER + '% verse\nV: Vocal\n(3z8B8z8z16|\nV: Ins\nC32|\n', 11,  # the vocal note cuts the Ins note off-grid
     "group 1, Vocal, bar 1: a note at quarter 2/3 lasting 2/3 quarter notes is off the power-of-two grid"),
    (header("C", unit=1024, meter="1/32") + '% verse\nV: Vocal\n(2CDz24z4z|\nV: Ins\nZ|\n', 11,
     "lasting 3/512 quarter notes is off the power-of-two grid \\(no L:1/N with N a power of two up to 1024"),
    (SCORE.replace("B8d8g16|", "(5B4d4g4b4d4z12|"), 13,
     "the tuplet \\(5 has no default ratio \\(the dialect has one for \\(2, \\(3, \\(4, \\(6, \\(8\\); write \\(5:q"),
    (SCORE.replace("B8d8g16|", "(3B12(3d8g8z8z8|"), 13, "a tuplet inside a tuplet at '\\(3d8g8z8z8'"),
    (SCORE.replace("B8d8g16|", "(3B12d12|"), 13, "bar 1: a tuplet is still open at the end of the bar \\(1 more "
     "note or rest expected\\)"),
    (SCORE.replace("B8d8g16|", "B8d8g16(3|"), 13, "a tuplet is still open at the end of the bar \\(3 more notes"),
    (SCORE.replace("B8d8g16|", "( 3B12d12g12z8|"), 13, "does not have at '\\( 3B12d12g12z8' \\(a tuplet is "
     "written \\(p, \\(p:q or \\(p:q:r, each a digit from 2 to 9\\)"),
    (SCORE.replace("B8d8g16|", "(3::3B12d12g12z8|"), 13, "does not have at '::3B12d12g12z8' \\(a tuplet"),
    (SCORE.replace("Z|\nV: Ins\nB8", "Z4|\nV: Ins\nB8"), 11, "5 bars"),
    (SCORE.replace('"G"z32|Z|', 'z32|Z|').replace("B8d8g16|e32|", '"G"B8d8g16|e32|'), 13,
     "a chord symbol in Ins \\('G'\\); the native dialect keeps chord symbols in Vocal"),
    (SCORE.replace('"G"z32|Z|', '"G""C"z32|Z|'), 11, "two different chord symbols at the same time"),
    (SCORE.replace('"G"z32|Z|', '"Gsus9"z32|Z|'), 11, "unsupported chord symbol 'Gsus9'"),
    (SCORE.replace("% verse", "% Verse"), 14, "unknown section label 'Verse'"),
    (SCORE.replace("% verse", "% solo"), 14, "unknown section label 'solo'"),
    (SCORE.replace('"G"z32|Z|', '"G"z16[K:D]z16|Z|').replace("B8d8g16|", "B8d8[K:D]g16|"), 11,
     "a key change inside a bar \\(K:D\\)"),
    (SCORE.replace("% verse\nV: Vocal\n", "% verse\nV: Vocal\nK:D\n"), 16, "change key at different times"),
    (HEADER + "% verse\nV: Vocal\nG32|\nV: Ins\nZ|\n% chorus\nV: Vocal\nM:3/4\nd24|\nV: Ins\nB32|\n", 19,
     "Vocal and Ins differ in meter from bar 2 on"),
    (SCORE.replace("G16A16|B32|", "G16A16|B32|Z|"), 18, "group 2: Vocal has 2 bars, Ins 3"),
    (SCORE.replace('"C"d8^c8=c16|', '"C"d8^c8=c16-|'), 16, "Vocal: a tie is left open at the end of the score"),
    (SCORE.replace("B8d8g16|e32|", "B8d8g16-|e32|"), 13, "a tie changes the pitch"),
    (SCORE.replace("B8d8g16|", "B8d8z16-|"), 13, "a rest with an accidental, octave mark or tie"),
    (HEADER + "% intro\nV: Vocal\nZ|\nV: Ins\nZ|\n", 11, "no sounding notes"),
    (header(meter="4/512", unit=1024) + "% verse\nV: Vocal\nG8|\nV: Ins\nZ|\n", 11, "finer than L:1/1024"),
    ("  \n", 1, "the score is blank"),
]


@pytest.mark.parametrize("score,line,words", REFUSED)
def test_what_upstream_refuses_is_refused_naming_its_line(score, line, words):
    with pytest.raises(ScoreError, match=rf"^score line {line}: .*{words}") as caught:
        edit_score(score)
    assert "\n" not in str(caught.value)  # one line


def test_upstreams_style_tags_and_labels():
    assert instrumental_style("pop, piano.") == "Instrumental, pop, piano, no vocals, no singing, no choir, " \
                                                "no spoken words."
    assert instrumental_style("instrumental jazz, no vocals") == "instrumental jazz, no vocals, no singing, " \
                                                                 "no choir, no spoken words."
    assert instrumental_style(instrumental_style("rock")) == instrumental_style("rock")
    assert lyric_tags("X:1\n% pre-chorus\n") == "[Pre-Chorus]\n" and lyric_tags("X:1\n") == ""
    assert SECTIONS == ("intro", "verse", "pre-chorus", "chorus", "bridge", "interlude", "outro", "instrumental")


def test_the_render_request_is_the_one_upstreams_example_builds():
    # upstream: dict(style=instrumental_style(style), lyrics=lyric_tags(text), abc=text,
    #                cot="full" if the score keeps chords else "melody", seed=seed); validate_request accepts it
    asked = SongRequest("lo-fi piano", "", abc=SCORE, instrumental=True, seed=2**63 - 1, id="clip")
    render = render_request(asked, edit_score(SCORE))
    assert (render.style, render.lyrics, render.abc, render.cot, render.seed, render.instrumental) == \
        ("Instrumental, lo-fi piano, no vocals, no singing, no choir, no spoken words.", "[Intro]\n\n[Verse]\n",
         EDITED, "full", 2**63 - 1, False)
    source, expected, _, _ = CASES["no section label: no tags"]
    bare = render_request(replace(asked, abc=source), edit_score(source))
    assert bare.lyrics == "" and bare.abc == expected  # upstream renders it with empty lyrics
    assert SongRequest.from_dict(bare.to_dict()) == bare


def test_the_steps_plan_with_upstreams_tags_then_render_the_edit():
    asked = []

    def plan_score(request):
        asked.append(request)
        return SimpleNamespace(abc=SCORE, truncated=False, timing={"seconds": 1.5, "mean_logprob": -2.0})

    steps = plan_steps(SongRequest("pop", "", instrumental=True, seed=5), plan_score)
    assert asked[0].lyrics == PLANNING_LYRICS and asked[0].cot == "full" and asked[0].seed == 5
    assert not asked[0].instrumental and asked[0].style == "pop"
    render = steps.render
    assert (render.abc, render.cot, render.lyrics, render.seed) == (EDITED, "full", "[Intro]\n\n[Verse]\n", 5)
    assert render.style == instrumental_style("pop") and not render.instrumental
    record = steps.record()
    assert record["planned_by"] == "model" and record["render_request"]["abc"] == EDITED
    with pytest.raises(ValueError, match="truncated"):
        plan_steps(SongRequest("pop", "", instrumental=True),
                   lambda r: SimpleNamespace(abc=SCORE, truncated=True, timing={}))
    with pytest.raises(ScoreError, match="^the planned score line 1"):
        plan_steps(SongRequest("pop", "", instrumental=True),
                   lambda r: SimpleNamespace(abc="la la", truncated=False, timing={}))


def test_the_request_field():
    assert SongRequest("pop", "", instrumental=True).to_dict()["instrumental"] is True
    assert "instrumental" not in SongRequest("pop", "la").to_dict()  # other songs keep their identity
    with pytest.raises(ValueError, match="SongRequest.instrumental must be true or false, got 'yes'"):
        SongRequest("pop", "la", instrumental="yes")
    with pytest.raises(ValueError, match="SongRequest.instrumental needs cot 'full' or 'melody'"):
        SongRequest("pop", "la", cot="off", instrumental=True)
    with pytest.raises(ValueError, match="^SongRequest.abc: score line 6"):
        SongRequest("pop", "", abc=SCORE.replace('V: Vocal clef', 'V: Lead clef'), instrumental=True)
    with pytest.raises(ValueError, match="SongRequest.lyrics must be non-blank"):
        SongRequest("pop", "")
    assert SongRequest("pop", "", abc=EDITED).lyrics == ""  # a given score may render with no lyrics, as upstream's
    with pytest.raises(ValueError, match="SongRequest.lyrics must be non-blank text \\(or '' for none\\)"):
        SongRequest("pop", " ", abc=EDITED)
    fields, _ = request_from_json({"style": "pop", "instrumental": True})
    assert fields["lyrics"] == "" and SongRequest(**fields).instrumental
    with pytest.raises(UsageError, match="lyrics must be non-blank text when given"):
        request_from_json({"style": "pop", "lyrics": "", "instrumental": True})
    with pytest.raises(ValueError, match="SongRequest.instrumental must be true or false, got 1"):
        SongRequest(**request_from_json({"style": "pop", "lyrics": "la", "instrumental": 1})[0])


GENERATION = {"abc": {"max_tokens": 10, "min_tokens": 4}, "semantic": {"max_tokens": 30, "min_tokens": 10},
              "ode_steps": 4}


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, tiny_vae_dir, tmp_path_factory):
    from yue2_vllm.checkpoint import HashCache
    from yue2_vllm.pipeline import YuE2Pipeline

    cache = HashCache(tmp_path_factory.mktemp("hashes") / "cache.json")
    return YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                        load=LoadOptions(hash_cache=cache))


def test_an_instrumental_song_on_the_torch_backend_records_each_step_and_resumes(pipe, tmp_path):
    request = SongRequest("piano pop", "", abc=SCORE, instrumental=True, seed=3, id="inst")
    planned = pipe.generate_to(tmp_path / "inst", request, stage="plan")
    assert planned["status"] == "planned" and planned["abc"] == EDITED
    record = json.loads((tmp_path / "inst" / "instrumental.json").read_text())
    assert (tmp_path / "inst" / "planned.abc").read_text() == SCORE
    assert (tmp_path / "inst" / "score.abc").read_text() == EDITED
    assert record["changes"]["vocal_notes_moved_to_ins"] == 4 and record["planned_by"] == "request"
    document = pipe.generate_to(tmp_path / "inst", request, resume=True)
    assert document["status"] == "complete" and document["stages_reused"] == ["plan"]
    render = SongRequest.from_dict(record["render_request"])
    direct = pipe(render)  # the song is the edited score rendered as upstream's recipe asks
    tokens = __import__("numpy").load(tmp_path / "inst" / "semantic.npy").tolist()
    assert tokens == direct.semantic.tokens
    again = pipe.generate_to(tmp_path / "inst", request, resume=True)
    assert again["resumed"] is True
    result = json.loads((tmp_path / "inst" / "result.json").read_text())
    assert result["instrumental"] is True and "instrumental.json" in result["artifacts"]
    assert "instrumental" not in pipe.generate_to(tmp_path / "plain", render)  # other songs: as they always were


def test_a_score_with_no_labels_renders_with_no_lyrics_and_the_songs_token_budget(pipe, tmp_path):
    source, expected, _, _ = CASES["no section label: no tags"]
    request = SongRequest("piano", "", abc=source, instrumental=True, seed=4, id="bare")
    document = pipe.generate_to(tmp_path / "bare", request, semantic_sampling={"max_tokens": 12, "min_tokens": 12})
    assert document["status"] == "complete" and document["instrumental"] is True
    assert (tmp_path / "bare" / "score.abc").read_text() == expected
    render = json.loads((tmp_path / "bare" / "instrumental.json").read_text())["render_request"]
    assert render["lyrics"] == "" and render["cot"] == "full"
    # the recipe leaves the semantic budget to the song (upstream's clip example caps it at seconds·25+250)
    assert len(__import__("numpy").load(tmp_path / "bare" / "semantic.npy")) == 12


def test_a_planned_instrumental_whose_score_is_truncated_fails_its_plan_as_upstream_stops(pipe, tmp_path):
    request = SongRequest("piano pop", "", instrumental=True, seed=3, id="bad")
    with pytest.raises(ValueError, match="the planned score was truncated; upstream's recipe stops here"):
        pipe.generate_to(tmp_path / "bad", request)  # the tiny model's 10-token score is cut off
    state = json.loads((tmp_path / "bad" / "run_state.json").read_text())
    assert state["state"] == "plan_failed" and not (tmp_path / "bad" / "score.abc").exists()


# --------------------------------------------------------------------------- the CLI, batch rows and vLLM

from test_cli import FAST, config_file, model_args  # noqa: E402,F401 (config_file: a fixture)


def test_generate_instrumental_takes_resume_and_refusals(tiny_model_dir, tiny_vae_dir, config_file, tmp_path,
                                                         capsys):
    from yue2_vllm.cli import main

    models = model_args(tiny_model_dir, tiny_vae_dir, config_file)
    (tmp_path / "score.abc").write_bytes(SCORE.replace("\n", "\r\n").encode())
    song = ["--style", "piano", "--instrumental", "--abc-file", str(tmp_path / "score.abc"), "--seed", "7",
            "--id", "i"]
    assert main(["generate", *models, *FAST, *song, "--takes", "2", "--best-of", "--output", str(tmp_path / "o")]) == 0
    root = tmp_path / "o" / "i"
    listing = json.loads((root / "takes.json").read_text())
    assert listing["complete"] == [1, 2] and listing["pick"] in (1, 2)
    for directory in (root, root / "takes" / "2"):
        assert (directory / "score.abc").read_text() == EDITED
        assert (directory / "planned.abc").read_bytes() == SCORE.replace("\n", "\r\n").encode()
        record = json.loads((directory / "instrumental.json").read_text())
        assert record["changes"]["line_endings"] == "crlf read as lf"
        assert json.loads((directory / "request.json").read_text())["instrumental"] is True
    capsys.readouterr()
    assert main(["generate", *models, *FAST, *song, "--takes", "2", "--resume", "--output", str(tmp_path / "o")]) == 0
    assert all(json.loads(line)["resumed"] for line in capsys.readouterr().out.strip().splitlines()[:2])
    assert main(["generate", *models, *FAST, "--style", "piano", "--instrumental", "--cot", "off",
                 "--output", str(tmp_path / "p")]) == 2
    assert "instrumental needs cot 'full' or 'melody'" in capsys.readouterr().err
    (tmp_path / "bad.abc").write_text(SCORE.replace("K:G", "K:H"))
    assert main(["generate", *models, *FAST, "--style", "piano", "--instrumental", "--abc-file",
                 str(tmp_path / "bad.abc"), "--output", str(tmp_path / "p")]) == 2
    assert "--abc-file: SongRequest.abc: score line 8: unsupported key 'H'" in capsys.readouterr().err
    (tmp_path / "bad.abc").write_text(SCORE.replace("% verse", "% Chorus"))
    assert main(["generate", *models, *FAST, "--style", "piano", "--instrumental", "--abc-file",
                 str(tmp_path / "bad.abc"), "--output", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err  # one line naming the score line and the reason, no traceback
    assert err.count("\n") == 1 and "score line 14: unknown section label 'Chorus'" in err and "Traceback" not in err
    assert not (tmp_path / "p").exists()


def test_batch_rows_take_the_switch_and_name_a_non_boolean(tiny_model_dir, tiny_vae_dir, config_file, tmp_path):
    from yue2_vllm.cli import main

    rows = [{"id": "a", "style": "pop", "abc": SCORE, "instrumental": True},
            {"id": "b", "style": "pop", "lyrics": "la", "instrumental": "yes"}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["batch", *model_args(tiny_model_dir, tiny_vae_dir, config_file), *FAST, "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out")]) == 1
    a, b = json.loads((tmp_path / "out" / "batch.json").read_text())["results"]
    assert a["status"] == "complete" and (tmp_path / "out" / "a" / "score.abc").read_text() == EDITED
    assert b["status"] == "failed" and "instrumental must be true or false, got 'yes'" in b["reason"]


from yue2_vllm.engine.backend import vllm_version  # noqa: E402


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_an_instrumental_song_on_vllm_is_its_render_request_song(tiny_model_dir, tiny_vae_dir, engines, tmp_path):
    with engines.pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                          ar=AROptions(backend="vllm")) as pipe:
        request = SongRequest("jazz", "", abc=SCORE, instrumental=True, seed=9, id="v")
        document = pipe.generate_to(tmp_path / "v", request)
        assert document["status"] == "complete"
        assert document["timing"]["semantic"]["backend_actual"] == "vllm"
        render = SongRequest.from_dict(json.loads((tmp_path / "v" / "instrumental.json").read_text())["render_request"])
        assert render.style == "Instrumental, jazz, no vocals, no singing, no choir, no spoken words."
        assert render.cot == "full" and render.lyrics == "[Intro]\n\n[Verse]\n"
        direct = pipe(render)
        import numpy as np

        assert np.load(tmp_path / "v" / "semantic.npy").tolist() == direct.semantic.tokens
        assert json.loads((tmp_path / "v" / "result.json").read_text())["instrumental"] is True
        assert (tmp_path / "v" / "score.abc").read_text() == EDITED


def test_the_post_body_names_the_field_it_refuses(pipe):
    from yue2_vllm.serve.submission import RequestInvalid, parse_submission

    def refused(body: dict):
        with pytest.raises(RequestInvalid) as caught:
            parse_submission(pipe, json.dumps(body).encode(), "j" + "0" * 20)
        return caught.value.field, caught.value.message

    assert refused({"style": "pop", "lyrics": "la", "instrumental": "yes"}) == \
        ("instrumental", "instrumental must be true or false, got 'yes'")
    field, message = refused({"style": "pop", "instrumental": True, "cot": "off"})
    assert field == "instrumental" and "needs cot 'full' or 'melody'" in message
    field, message = refused({"style": "pop", "instrumental": True, "abc": SCORE.replace("T:\n", "T:x\n")})
    assert field == "abc" and message.startswith("abc: score line 2: expected a blank title 'T:'")
    assert refused({"style": "pop", "instrumental": True, "lyrics": ""})[0] == "lyrics"
    assert refused({"style": "pop"}) == ("lyrics", "lyrics: missing")
    job = parse_submission(pipe, json.dumps({"style": "pop", "instrumental": True, "stage": "plan",
                                             "takes": 2}).encode(), "j" + "1" * 20)
    assert job.request.instrumental and job.request.lyrics == "" and job.takes.takes == 2


def test_a_take_given_take_ones_edited_score_renders_that_same_score():
    from yue2_vllm.takes import take_request

    first = plan_steps(SongRequest("pop", "", instrumental=True, seed=5),
                       lambda r: SimpleNamespace(abc=SCORE, truncated=False, timing={}))
    shared = take_request(SongRequest("pop", "", instrumental=True, seed=5), 2, abc=first.edit.text)
    second = plan_steps(shared, lambda r: pytest.fail("a shared score is not planned again"))
    assert second.render.abc == first.render.abc and second.render.style == first.render.style
    assert second.render.seed == 6 and second.record()["planned_by"] == "request"
    assert second.edit.changes["vocal_notes_moved_to_ins"] == 0


def test_a_cancelled_instrumental_song_keeps_its_steps_and_resumes_to_the_same_song(pipe, tmp_path):
    request = SongRequest("piano pop", "", abc=SCORE, instrumental=True, seed=5, id="c")
    tokens = []
    with pytest.raises(InterruptedError):
        pipe.generate_to(tmp_path / "c", request, on_token=lambda phase, token: tokens.append(phase),
                         cancelled=lambda: tokens.count("semantic") >= 4)
    assert json.loads((tmp_path / "c" / "run_state.json").read_text())["state"] == "cancelled"
    assert (tmp_path / "c" / "score.abc").read_text() == EDITED and (tmp_path / "c" / "planned.abc").exists()
    document = pipe.generate_to(tmp_path / "c", request, resume=True)
    assert document["status"] == "complete" and document["stages_reused"] == ["plan"]
    whole = pipe.generate_to(tmp_path / "whole", request)
    numpy = __import__("numpy")
    assert numpy.load(tmp_path / "c" / "semantic.npy").tolist() == numpy.load(tmp_path / "whole" / "semantic.npy").tolist()


@pytest.mark.slow  # a batch-invariant (float32) engine of its own; CI runs -m slow
@pytest.mark.skipif(vllm_version() is None, reason="vllm is not installed")
def test_under_reproducible_an_instrumental_song_is_its_seeds_song_whatever_else_the_engine_serves(
        tiny_model_dir, tiny_vae_dir, tmp_path):
    import numpy as np

    from yue2_vllm.pipeline import YuE2Pipeline
    from yue2_vllm.scheduler import generate_many

    mine = SongRequest("jazz", "", abc=SCORE, instrumental=True, seed=21, id="mine")
    others = [SongRequest("pop", f"la la {i}", seed=i, id=f"o{i}", cot="off") for i in range(4)]
    with YuE2Pipeline(tiny_model_dir, tiny_vae_dir, generation_config=GENERATION,
                      ar=AROptions(backend="vllm", reproducible=True),
                      engine=EngineOptions(max_num_seqs=8, max_num_batched_tokens=64)) as pipe:
        alone = generate_many(pipe, [mine], tmp_path / "alone", concurrency=1)
        together = generate_many(pipe, [mine, *others], tmp_path / "together", concurrency=5)
    assert {h.state for h in [*alone, *together]} == {"complete"}
    one, many = tmp_path / "alone" / "mine", tmp_path / "together" / "mine"
    assert np.array_equal(np.load(one / "semantic.npy"), np.load(many / "semantic.npy"))
    document = json.loads((many / "result.json").read_text())
    assert document["batch_invariant"] is True and "batch_note" not in document, document.get("batch_note")
    assert (many / "score.abc").read_text() == EDITED
