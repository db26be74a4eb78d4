"""A cover's request (cover.cover_request): the transcribed score byte for byte, cot melody, the transcription's
record beside it and outside the song's identity; what the cover decides is refused when given."""
import pytest

from yue2_vllm.cover import cover_request
from yue2_vllm.protocol import SongRequest
from yue2_vllm.song.run_dir import latent_identity, run_identity

from test_transcription_result import transcription

CONFIG, WEIGHTS = {"generation": {"ode_steps": 2}}, {"mot": "m" * 64, "vae": "v" * 64}


def test_a_cover_renders_its_score_byte_for_byte_with_cot_melody_and_records_where_it_came_from():
    made = transcription()
    request = cover_request(made, style="pop", lyrics="[verse]\nla\n", seed=7, id="hum")
    assert (request.abc, request.cot, request.seed, request.id) == (made.abc, "melody", 7, "hum")
    assert request.transcription == {**made.summary(), "edited": False}
    assert request.to_dict()["transcription"] == request.transcription
    assert SongRequest.from_dict(request.to_dict()) == request  # request.json reads back as the same request


def test_the_record_is_left_out_of_the_songs_identity():
    """The song depends on its score, not on where the score came from: the same score given as `abc` is the same
    song (its run and its latents), with or without the record, and a request without one has none in its dict."""
    made = transcription()
    cover = cover_request(made, style="pop", lyrics="la")
    plain = SongRequest("pop", "la", cot="melody", abc=made.abc)
    assert "transcription" not in plain.to_dict() and hash(cover) == hash(plain)
    assert run_identity(cover, CONFIG, WEIGHTS) == run_identity(plain, CONFIG, WEIGHTS)
    assert latent_identity(cover, CONFIG, WEIGHTS) == latent_identity(plain, CONFIG, WEIGHTS)


@pytest.mark.parametrize("fields,message", [
    ({"abc": "X:1\n"}, "SongRequest.abc: a cover's abc is its transcription's"),
    ({"transcription": {}}, "SongRequest.transcription: a cover's transcription is its transcription's"),
    ({"cot": "full"}, "SongRequest.cot: a cover renders its transcribed melody with cot 'melody', got 'full'"),
    ({"seed": -1}, "SongRequest.seed must be an integer"),
])
def test_what_the_cover_decides_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        cover_request(transcription(), style="pop", lyrics="la", **fields)
