"""A transcription request: checked once, each refusal one line naming its field; fields the chosen transcriber
does not take refused."""
import pytest

from yue2_vllm.transcription.request import TranscriptionRequest
from yue2_vllm.transcription.result import TranscriptionError


def test_defaults_and_where_the_melody_goes():
    request = TranscriptionRequest()
    assert (request.transcriber, request.meter_pair, request.melody_voice) == ("pyin", (4, 4), "Vocal")
    assert TranscriptionRequest(voice="ins").melody_voice == "Ins"
    assert TranscriptionRequest(transcriber="sheetsage2").melody_voice == "both"
    assert TranscriptionRequest(transcriber="sheetsage2", voice="vocal").melody_voice == "Vocal"
    assert TranscriptionRequest(meter="6/8", bpm=90, key="F#m", pickup_beats=1.5).meter_pair == (6, 8)


def test_a_request_round_trips_through_its_fields():
    request = TranscriptionRequest(bpm=96.5, meter="3/4", key="Bb", lyrics="[verse]\nla la", voice="ins",
                                   pickup_beats=1)
    assert TranscriptionRequest.from_dict(request.to_dict()) == request


@pytest.mark.parametrize("fields, field, reason", [
    ({"transcriber": "crepe"}, "transcriber", "'crepe' is not a transcriber (one of pyin, sheetsage2)"),
    ({"bpm": 12}, "bpm", "12 is outside 30-300 quarter notes a minute"),
    ({"bpm": "fast"}, "bpm", "expected a number, got 'fast'"),
    ({"bpm": True}, "bpm", "expected a number, got True"),
    ({"bpm": float("nan")}, "bpm", "expected a number, got nan"),
    ({"meter": "4/5"}, "meter", "'4/5' is not a meter this transcriber writes"),
    ({"meter": 4}, "meter", "4 is not a meter this transcriber writes"),
    ({"key": "H"}, "key", "'H' is not a key the score can name"),
    ({"key": ["C"]}, "key", "['C'] is not a key the score can name"),
    ({"lyrics": 7}, "lyrics", "expected text, got int"),
    ({"lyrics": "la " * 7000}, "lyrics", "21000 characters, more than 20000"),
    ({"voice": "both"}, "voice", "'both' is not a voice the pyin transcriber writes (one of vocal, ins)"),
    ({"pickup_beats": 4}, "pickup_beats", "4 is not a pickup the grid writes (0 up to 4 beats, in quarter beats)"),
    ({"pickup_beats": 0.3}, "pickup_beats", "0.3 is not a pickup the grid writes"),
    ({"pickup_beats": 2, "meter": "2/4"}, "pickup_beats", "2 is not a pickup the grid writes (0 up to 2 beats"),
    ({"transcriber": "sheetsage2", "bpm": 100}, "bpm", "sheetsage2 finds the tempo, meter, key and downbeat itself; "
                                                       "bpm is for the pyin transcriber"),
    ({"transcriber": "sheetsage2", "meter": "4/4"}, "meter", "sheetsage2 finds the tempo"),
    ({"transcriber": "sheetsage2", "voice": "choir"}, "voice", "'choir' is not a voice the sheetsage2 transcriber"),
])
def test_each_refusal_names_its_field(fields, field, reason):
    with pytest.raises(TranscriptionError) as caught:
        TranscriptionRequest(**fields)
    assert caught.value.field == field and str(caught.value).startswith(f"{field}: {reason}")


def test_unknown_fields_and_non_objects_are_refused_by_name():
    with pytest.raises(TranscriptionError, match=r"^tempo: not a transcription field \(the fields are bpm, key"):
        TranscriptionRequest.from_dict({"tempo": 90})
    with pytest.raises(TranscriptionError, match="^request: expected an object of fields, got list"):
        TranscriptionRequest.from_dict([])
