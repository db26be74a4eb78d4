"""The Standard MIDI File writer (yue2_vllm/midi.py): a small score's file byte for byte, the variable-length
quantities, the division a tuplet needs, and what MIDI cannot write refused in one line."""
import struct

import pytest

from yue2_vllm.midi import midi_file, ticks_per_quarter, variable_length
from yue2_vllm.score_notes import score_notes

from test_instrumental import header

# 2/4 in F at 120 quarters a minute: Vocal sings F then A under an F chord, Ins holds c for the bar.
SMALL = header("F", unit=8, meter="2/4", bpm=120) + '% verse\nV: Vocal\n"F"F2A2|\nV: Ins\nc4|\n'


def chunk(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack(">I", len(body)) + body


def test_a_small_score_byte_for_byte():
    end = b"\x00\xff\x2f\x00"
    conductor = (b"\x00\xff\x03\x05score"  # track name
                 b"\x00\xff\x51\x03\x07\xa1\x20"  # 500,000 microseconds a quarter: Q:1/4=120
                 b"\x00\xff\x58\x04\x02\x02\x18\x08"  # 2/4: 2, 2**2, 24 clocks a beat, 8 32nds a quarter
                 b"\x00\xff\x59\x02\xff\x00"  # F major: one flat
                 b"\x00\xff\x06\x05verse" + end)  # the section, as a marker
    vocal = (b"\x00\xff\x03\x05Vocal\x00\xc0\x35"  # channel 1, voice oohs
             b"\x00\x90\x41\x60"  # F4 on at 0
             b"\x83\x60\x80\x41\x40"  # off after 480 ticks (one quarter)
             b"\x00\x90\x45\x60"  # A4 on
             b"\x83\x60\x80\x45\x40" + end)
    ins = (b"\x00\xff\x03\x03Ins\x00\xc1\x00"  # channel 2, piano
           b"\x00\x91\x48\x58"  # C5 on
           b"\x87\x40\x81\x48\x40" + end)  # off after 960 ticks
    chords = (b"\x00\xff\x03\x06Chords\x00\xc2\x30"  # channel 3, strings
              b"\x00\xff\x01\x01F"  # the symbol as text
              b"\x00\x92\x29\x38\x00\x92\x35\x38\x00\x92\x39\x38\x00\x92\x3c\x38"  # F2, then F3 A3 C4
              b"\x87\x40\x82\x29\x40\x00\x82\x35\x40\x00\x82\x39\x40\x00\x82\x3c\x40" + end)
    expected = chunk(b"MThd", struct.pack(">HHH", 1, 4, 480)) + b"".join(
        chunk(b"MTrk", track) for track in (conductor, vocal, ins, chords))
    assert midi_file(score_notes(SMALL)) == expected


def test_a_repeated_pitch_is_struck_again_and_a_chordless_score_has_no_chord_track():
    data = midi_file(score_notes(header("C", unit=8, meter="2/4", bpm=120) + "% verse\nV: Vocal\nC2C2|\nV: Ins\nZ|\n"))
    assert data[:14] == chunk(b"MThd", struct.pack(">HHH", 1, 3, 480))
    # at tick 480 the first C ends before the second starts
    assert b"\x00\x90\x3c\x60\x83\x60\x80\x3c\x40\x00\x90\x3c\x60\x83\x60\x80\x3c\x40\x00\xff\x2f\x00" in data


def test_variable_length_quantities():
    assert [variable_length(v) for v in (0, 0x40, 0x7F, 0x80, 0x2000, 0x3FFF, 0x4000, 0x0FFFFFFF)] == [
        b"\x00", b"\x40", b"\x7f", b"\x81\x00", b"\xc0\x00", b"\xff\x7f", b"\x81\x80\x00", b"\xff\xff\xff\x7f"]
    with pytest.raises(ValueError, match="cannot be negative"):
        variable_length(-1)
    with pytest.raises(ValueError, match=r"^MIDI cannot write 268435456 ticks or bytes in one variable-length "
                                         r"quantity \(at most 268435455 = 0x0FFFFFFF, four bytes\)"):
        variable_length(0x10000000)  # five bytes: no reader takes it


def test_the_division_places_every_tuplet_exactly():
    triplet = header("C", unit=8) + "% verse\nV: Vocal\n(3CDE z2 G4|\nV: Ins\nZ|\n"
    assert ticks_per_quarter(score_notes(triplet)) == 480
    septuplet = header("C", unit=8) + "% verse\nV: Vocal\n(7:4CDEFGAB z2 G2|\nV: Ins\nZ|\n"
    assert ticks_per_quarter(score_notes(septuplet)) == 3360  # a seventh of 2 quarters: 480 * 7 ticks a quarter
    # sevenths and ninths of the finest grid need 80,640 ticks a quarter, past the header's 32,767: the finest
    # power-of-two grid and triplets instead, where times round to the nearest tick
    fine = header("C", unit=1024, meter="1/32") + "% verse\nV: Vocal\nz(7:4CDEFGAB(9:8CDEFGABcd z16z3|\nV: Ins\nZ|\n"
    assert ticks_per_quarter(score_notes(fine)) == 3840
    assert midi_file(score_notes(fine))[12:14] == struct.pack(">H", 3840)


def test_what_midi_cannot_write_is_refused():
    # 3.8 KB of score: 560 silent bars of 255 whole notes, then a note 274,176,000 ticks in
    silence = header("C", unit=1, meter="255/1") + "% verse\n" + "V: Vocal\nZ4|\nV: Ins\nZ4|\n" * 140
    with pytest.raises(ValueError, match="^MIDI cannot write 274176000 ticks or bytes in one variable-length"):
        midi_file(score_notes(silence + "V: Vocal\nC" + "z" * 254 + "|\nV: Ins\nZ|\n"))
    with pytest.raises(ValueError, match=r"^MIDI cannot write the tempo Q:1/4=3 "):
        midi_file(score_notes(header("C", bpm=3) + "% verse\nV: Vocal\nC32|\nV: Ins\nZ|\n"))
    with pytest.raises(ValueError, match=r"^MIDI cannot write the meter 256/4"):
        midi_file(score_notes(header("C", unit=4, meter="256/4") + "% verse\nV: Vocal\n" + "C" * 256 + "|\n"
                              "V: Ins\nZ|\n"))
