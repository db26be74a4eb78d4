import pytest

from yue2_vllm import protocol as p
from yue2_vllm.protocol import (ABC_END, ABC_START, EOD, MUSIC_START, GenerationConfig, Sampling, SongRequest,
                                abc_prompt, chunk_ranges, negative_prompt, semantic_prompt)


class BytesEncoder:
    """A transparent stand-in for the BPE: one id per UTF-8 byte, so expected ids are hand-computable."""

    def encode(self, text):
        return list(text.encode("utf-8"))


ENC = BytesEncoder()


def ids(text):
    return list(text.encode("utf-8"))


def test_constants():
    assert (p.EOD, p.ABC_START, p.ABC_END, p.MUSIC_START, p.MUSIC_END) == (151643, 151847, 151848, 151851, 151852)
    assert (p.CODEC_OFFSET, p.CODEC_SIZE, p.VOCAB_SIZE, p.CONTEXT) == (151853, 32768, 184704, 24576)
    assert p.CODEC_OFFSET + p.CODEC_SIZE == p.LATENT_START == 184621
    assert len(p.allowed_token_ids("abc")) == 151644 and p.allowed_token_ids("abc")[-1] == ABC_END
    semantic = p.allowed_token_ids("semantic")
    assert len(semantic) == 32769 and semantic[0] == 151853 and semantic[-1] == p.MUSIC_END


@pytest.mark.parametrize("style,lyrics", [("pop, piano", "[verse]\nla la"), ("华语流行，钢琴", "[verse]\n你好，世界")])
def test_prompts_all_cot_modes(style, lyrics):
    full = SongRequest(style, lyrics, cot="full")
    text = ("Generate a chord-annotated ABC transcription, then generate music with codec tokens from the given "
            f"conditions.\n[Tags]\n{style}\n[Lyrics]\n{lyrics}\n")
    assert full.text() == text
    assert abc_prompt(full, ENC) == [EOD] + ids(text) + [ABC_START]
    abc_ids = [88, 3, 151642]
    assert semantic_prompt(full, ENC, abc_ids) == [EOD] + ids(text) + [ABC_START, 88, 3, 151642, ABC_END, MUSIC_START]

    melody = SongRequest(style, lyrics, cot="melody")
    mtext = ("Generate a melody-only ABC transcription without chord symbols, then generate music with codec "
             f"tokens from the given conditions.\n[Tags]\n{style}\n[Lyrics]\n{lyrics}\n")
    assert abc_prompt(melody, ENC) == [EOD] + ids(mtext) + [ABC_START]

    off = SongRequest(style, lyrics, cot="off")
    otext = f"Generate music with codec tokens from the given conditions.\n[Tags]\n{style}\n[Lyrics]\n{lyrics}\n"
    assert semantic_prompt(off, ENC) == [EOD] + ids(otext) + [ABC_START, ABC_END, MUSIC_START]
    with pytest.raises(ValueError, match="no abc phase"):
        abc_prompt(off, ENC)


def test_negative_prompts_are_instruction_only():
    off = SongRequest("rock", "words", cot="off")
    assert negative_prompt(off, ENC) == [EOD] + ids("Generate music with codec tokens from the given conditions.") \
        + [MUSIC_START]
    full = SongRequest("rock", "words")
    expected = [EOD] + ids(p.INSTRUCTIONS["full"]) + [ABC_START, 7, 9, ABC_END, MUSIC_START]
    assert negative_prompt(full, ENC, [7, 9]) == expected
    with pytest.raises(ValueError, match="exact positive abc ids"):
        negative_prompt(full, ENC)


def test_external_abc_is_encoded_once_and_has_no_abc_phase():
    request = SongRequest("jazz", "hey", cot="melody", abc="X:1\nK:C\nCDEF|")
    assert semantic_prompt(request, ENC) == [EOD] + ids(request.text()) + [ABC_START] + ids("X:1\nK:C\nCDEF|") \
        + [ABC_END, MUSIC_START]
    with pytest.raises(ValueError, match="external ABC"):
        abc_prompt(request, ENC)


def test_abc_ids_must_be_text_ids():
    with pytest.raises(ValueError, match=r"abc_ids\[1\] = 151643"):
        semantic_prompt(SongRequest("a", "b"), ENC, [1, EOD])


def test_real_tokenizer_prefix(tokenizer):
    request = SongRequest("ab", "ab", cot="off")
    prompt = semantic_prompt(request, tokenizer)
    assert prompt[0] == EOD and prompt[-3:] == [ABC_START, ABC_END, MUSIC_START]
    assert all(0 <= i < EOD for i in prompt[1:-3])
    # " ab" then "\n" in the synthetic vocabulary: "ab" is 2-gram #29 (alphabet " a..z") after 256 bytes.
    assert tokenizer.encode("ab") == [256 + 1 * 27 + 2]


def test_song_request_defaults_and_guidance():
    request = SongRequest("s", "l")
    assert (request.cot, request.seed, request.id, request.guidance) == ("full", 831001, "song", 1.0)
    assert SongRequest("s", "l", cot="melody").guidance == 1.0
    assert SongRequest("s", "l", cot="off").guidance == 1.01
    assert SongRequest("s", "l", cot="off", cfg_scale=1).guidance == 1.0
    assert SongRequest.from_dict(request.to_dict()) == request


@pytest.mark.parametrize("field,value,message", [
    ("cot", "half", "cot"), ("seed", -1, "seed"), ("seed", 2**63, "seed"), ("seed", True, "seed"),
    ("seed", 1.5, "seed"), ("id", "../x", "id"), ("id", "..", "id"), ("id", "a" * 181, "id"),
    ("cfg_scale", 20.5, "cfg_scale"), ("cfg_scale", float("nan"), "cfg_scale"), ("abc", "  ", "abc"),
    ("style", None, "style"), ("lyrics", 3, "lyrics"), ("style", "", "style must be non-blank"),
    ("style", " \n\t", "style must be non-blank"), ("lyrics", "", "lyrics must be non-blank"),
    ("lyrics", "\u3000", "lyrics must be non-blank"),
])
def test_song_request_validation_names_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SongRequest(**{"style": "s", "lyrics": "l", field: value})


def test_external_abc_needs_a_score_mode():
    with pytest.raises(ValueError, match="abc needs cot"):
        SongRequest("s", "l", cot="off", abc="X:1")
    with pytest.raises(ValueError, match="unknown field"):
        SongRequest.from_dict({"style": "s", "lyrics": "l", "tempo": 3})


def test_generation_defaults():
    config = GenerationConfig()
    assert config.abc == Sampling(0.7, 0.9, 30, 1.005, 100, 32, 4096)
    assert config.semantic == Sampling(1.0, 0.95, 100, 1.2, 50, 200, 9000)
    assert (config.ode_steps, config.ode_method, config.context, config.version) == (32, "midpoint", 24576,
                                                                                    "yue2-native-v1")
    merged = GenerationConfig.from_dict({"abc": {"max_tokens": 100}, "ode_steps": 8})
    assert merged.abc.max_tokens == 100 and merged.abc.top_k == 30 and merged.ode_steps == 8
    assert GenerationConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("field,value", [
    ("temperature", 5.5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.1), ("top_k", 0), ("top_k", 2.0),
    ("repetition_penalty", 0), ("penalty_window", 0), ("penalty_window", 101), ("max_tokens", 0),
    ("min_tokens", 9001), ("temperature", float("inf")),
])
def test_sampling_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        Sampling(**{field: value})


def test_budget_and_chunks():
    p.check_budget([0] * 15576, 9000)
    with pytest.raises(ValueError, match="24577 exceeds"):
        p.check_budget([0] * 15577, 9000)
    assert chunk_ranges(10, 100) == [(0, 10)]
    size = (24576 - 100 - 3) // 2
    assert size == 12236
    assert chunk_ranges(30000, 100) == [(0, 12236), (12236, 24472), (24472, 30000)]
    assert chunk_ranges(0, 100) == []
    with pytest.raises(ValueError, match="no room"):
        chunk_ranges(5, 24574)


@pytest.mark.parametrize("bad", [1.0, True, 2.5, None, "7"])
def test_token_ids_are_integers_never_coerced(bad):
    with pytest.raises(ValueError, match=r"abc_ids\[1\] = "):
        p.check_abc_ids([5, bad])
    with pytest.raises(ValueError, match=r"semantic prompt\[2\] = "):
        p.check_budget([EOD, 3, bad], 10, "semantic prompt")
    with pytest.raises(ValueError, match=r"semantic.tokens\[0\] = "):
        p.check_token_ids([bad], "semantic.tokens", 0, p.CODEC_SIZE)


def test_integral_ids_and_seeds_become_plain_ints():
    import numpy as np

    assert p.check_abc_ids(np.asarray([3, 4], dtype=np.int32)) == [3, 4]
    request = SongRequest("s", "l", seed=np.int64(7))
    assert type(request.seed) is int and request.to_dict()["seed"] == 7
    with pytest.raises(ValueError, match="seed must be an integer"):
        p.check_seed(5.0)
    with pytest.raises(ValueError, match="seed must be an integer"):
        p.check_seed(np.float64(3))


@pytest.mark.parametrize("context", [24577, 30000, 0, 12.5, True])
def test_nar_context_beyond_the_model_is_rejected(context):
    with pytest.raises(ValueError, match=r"context must be an integer in \[1, 24576\]"):
        chunk_ranges(10, 100, context)


def test_generation_config_takes_the_request_file_spelling():
    spelled = {"abc_sampling": {"max_tokens": 100}, "semantic_sampling": {"top_k": 5}, "ode_steps": 8}
    assert GenerationConfig.from_dict(spelled) == GenerationConfig.from_dict(
        {"abc": {"max_tokens": 100}, "semantic": {"top_k": 5}, "ode_steps": 8})
    with pytest.raises(ValueError, match="give 'abc' or 'abc_sampling', not both"):
        GenerationConfig.from_dict({"abc": {}, "abc_sampling": {}})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['steps'\]; the fields are abc \(or abc_sampling\), "
                                         r"semantic \(or semantic_sampling\), ode_steps, ode_method, context, version"):
        GenerationConfig.from_dict({"steps": 8})
    with pytest.raises(ValueError, match=r"GenerationConfig.semantic: Sampling.top_k must be an integer"):
        GenerationConfig.from_dict({"semantic_sampling": {"top_k": "5"}})
    with pytest.raises(ValueError, match="GenerationConfig must be an object, got list"):
        GenerationConfig.from_dict([])


def _prompt_of(tokens: int, cot: str = "full") -> SongRequest:
    """A request whose abc prompt (or, for cot off, semantic prompt) is exactly `tokens` ids long."""
    short = SongRequest("pop", "x", cot=cot)
    built = (abc_prompt if cot != "off" else semantic_prompt)(short, ENC)
    return SongRequest("pop", "x" * (1 + tokens - len(built)), cot=cot)


def test_long_song_admission_counts_the_scores_budget_at_the_real_context():
    rules = p.SongRules(GenerationConfig(), ENC)
    request = _prompt_of(2000)
    assert len(abc_prompt(request, ENC)) == 2000
    # 2,000 + a 4,096-token score + </abc> MUSIC_START + 20,000 = 26,098: refused before anything runs
    with pytest.raises(ValueError, match=r"the request is too long: semantic prompt \(with a score of up to abc "
                                         r"max_tokens 4096\) of 6098 tokens \+ max_tokens 20000 = 26098 exceeds"):
        rules.check_request(request, semantic_sampling={"max_tokens": 20000})
    rules.check_request(request, semantic_sampling={"max_tokens": 24576 - 2000 - 4096 - 2})  # exactly the context
    with pytest.raises(ValueError, match="24577 exceeds"):
        rules.check_request(request, semantic_sampling={"max_tokens": 24576 - 2000 - 4096 - 1})
    rules.check_request(request, {"max_tokens": 2574}, {"max_tokens": 20000})  # a shorter score makes room
    # an external score or cot off: the semantic prompt is known, nothing more is added
    off = _prompt_of(4576, cot="off")
    rules.check_request(off, semantic_sampling={"max_tokens": 20000})
    with pytest.raises(ValueError, match="24577 exceeds"):
        rules.check_request(off, semantic_sampling={"max_tokens": 20001})


def test_long_songs_nar_chunks_at_the_real_context():
    steps = GenerationConfig().ode_steps
    # the default 6-minute budget (9,000 frames) is one chunk behind a prefix of up to 6,573 tokens
    assert chunk_ranges(9000, 6573) == [(0, 9000)] and len(chunk_ranges(9000, 6574)) == 2
    # the longest admitted song behind 2,000 + 2,574 + 2 prompt tokens: 20,000 frames in chunks of 9,998
    assert chunk_ranges(20000, 4576) == [(0, 9998), (9998, 19996), (19996, 20000)]
    assert steps * len(chunk_ranges(20000, 4576)) == 96  # its one progress total (single-song and batched)


@pytest.mark.parametrize("context", [24577, 0, 12.5, True])
def test_generation_config_context_is_within_the_model(context):
    assert GenerationConfig(context=40).context == 40  # a tiny model's chunked NAR
    with pytest.raises(ValueError, match=r"GenerationConfig.context must be an integer in \[1, 24576\]"):
        GenerationConfig(context=context)


# --------------------------------------------------------------------------- seconds: a length the user asks for


def test_seconds_count_semantic_tokens_as_upstreams_tools_do():
    assert p.TOKENS_PER_SECOND == 25
    assert [p.seconds_tokens(s) for s in (60, 60.0, 10.03, 0.04, 0.039, 983.04)] == [1500, 1500, 250, 1, 0, 24576]
    assert p.tokens_seconds(1500) == 60.0 and p.MAX_SECONDS == 983.04
    for tokens in (1, 7, 200, 1500, 18478, 24576):  # the largest seconds whose cap is at most `tokens`
        seconds = p.seconds_for_tokens(tokens)
        assert p.seconds_tokens(seconds) <= tokens < p.seconds_tokens(round(seconds + 0.01, 2)) or \
            p.seconds_tokens(seconds) == tokens


@pytest.mark.parametrize("value, words", [
    (0, "must be a positive number of seconds"), (-3, "must be a positive number"), (float("nan"), "must be a pos"),
    (float("inf"), "must be a pos"), (True, "must be a pos"), ("60", "must be a pos"), (0.03, "must be at least 0.04"),
    (983.05, r"must be at most 983.04 \(the whole 24576-token context"), (1.3e308, "must be at most 983.04"),
])
def test_seconds_must_be_a_length_the_context_can_hold(value, words):
    with pytest.raises(ValueError, match=rf"SongRequest.seconds {words}"):
        SongRequest("pop", "la", seconds=value)


def test_seconds_is_a_float_on_the_request_and_absent_from_its_dict_when_unset():
    request = SongRequest("pop", "la", seconds=60)
    assert request.seconds == 60.0 and isinstance(request.seconds, float)
    assert request.to_dict()["seconds"] == 60.0 and SongRequest.from_dict(request.to_dict()) == request
    assert "seconds" not in SongRequest("pop", "la").to_dict()  # every other song keeps the identity it had


def test_seconds_is_the_semantic_phases_budget():
    rules = p.SongRules(GenerationConfig(), ENC)
    request = SongRequest("pop", "la", seconds=60)
    assert rules.phase_sampling(request, None, "semantic") == Sampling(max_tokens=1500)
    assert rules.phase_sampling(request, {"top_k": 5}, "semantic") == Sampling(max_tokens=1500, top_k=5)
    assert rules.phase_sampling(request, None, "abc") == p.ABC_DEFAULTS  # the score is not capped
    longer = SongRequest("pop", "la", seconds=400)  # beyond the default 9,000-token budget: it is the budget
    assert rules.phase_sampling(longer, None, "semantic").max_tokens == 10000
    with pytest.raises(ValueError, match=r"^seconds: seconds and semantic_sampling.max_tokens both set"):
        rules.phase_sampling(request, {"max_tokens": 100}, "semantic")
    with pytest.raises(ValueError, match=r"^seconds: 5 caps the song at 125 tokens, below the semantic phase's "
                                         r"min_tokens 200; ask for at least 8 seconds, or lower "
                                         r"semantic_sampling.min_tokens$"):
        rules.phase_sampling(SongRequest("pop", "la", seconds=5), None, "semantic")
    assert rules.phase_sampling(SongRequest("pop", "la", seconds=5), {"min_tokens": 100}, "semantic") == \
        Sampling(max_tokens=125, min_tokens=100)
    with pytest.raises(ValueError, match=r"^semantic_sampling: Sampling.top_p must be in \(0, 1\]"):
        rules.phase_sampling(request, {"top_p": 2}, "semantic")


def test_a_too_long_request_is_told_what_to_shorten_and_by_how_much():
    rules = p.SongRules(GenerationConfig(), ENC)
    request = _prompt_of(2000)  # 2,000 + 4,096 score + 2 + 20,000 = 26,098: 1,522 over
    with pytest.raises(ValueError) as refused:
        rules.check_request(request, semantic_sampling={"max_tokens": 20000})
    assert str(refused.value).endswith(
        "exceeds the 24576-token context; shorten the lyrics or style by 1522 tokens, or lower "
        "semantic_sampling.max_tokens to 18478 (739.12 s of song), or lower abc_sampling.max_tokens to 2574")
    rules.check_request(request, semantic_sampling={"max_tokens": 18478})  # each fix named is enough
    rules.check_request(request, {"max_tokens": 2574}, {"max_tokens": 20000})
    rules.check_request(_prompt_of(2000 - 1522), semantic_sampling={"max_tokens": 20000})

    asked = SongRequest(request.style, request.lyrics, seconds=800)  # the song's length names the field
    with pytest.raises(ValueError) as refused:
        rules.check_request(asked)
    assert str(refused.value) == (
        "seconds: the request is too long: semantic prompt (with a score of up to abc max_tokens 4096) of 6098 "
        "tokens + max_tokens 20000 = 26098 exceeds the 24576-token context; lower seconds to at most 739.12 "
        "(18478 tokens; asked: 800), or shorten the lyrics or style by 1522 tokens, or lower abc_sampling.max_tokens "
        "to 2574")
    rules.check_request(SongRequest(request.style, request.lyrics, seconds=739.12))
    with pytest.raises(ValueError, match="24577 exceeds"):
        rules.check_request(SongRequest(request.style, request.lyrics, seconds=739.16))
    given = SongRequest("pop", "x", cot="melody", abc="X:1\n" + "C" * 20000)  # a given score is the text to cut
    with pytest.raises(ValueError, match=r"semantic prompt of 20159 tokens \+ max_tokens 9000 = 29159 exceeds the "
                                         r"24576-token context; shorten the lyrics, style or score by 4583 tokens, "
                                         r"or lower semantic_sampling.max_tokens to 4417 \(176.68 s of song\)$"):
        rules.check_request(given, semantic_sampling={"max_tokens": 9000})


def test_the_longest_song_a_request_can_reach():
    rules = p.SongRules(GenerationConfig(), ENC)
    assert rules.longest_song(_prompt_of(2000)) == {"tokens": 18478, "seconds": 739.12, "prompt_tokens": 2002,
                                                    "score_budget_tokens": 4096, "context_tokens": 24576}
    off = rules.longest_song(_prompt_of(4576, cot="off"))
    assert (off["tokens"], off["seconds"], off["score_budget_tokens"]) == (20000, 800.0, 0)
    assert rules.longest_song(SongRequest("pop", "x", seconds=5)) == rules.longest_song(SongRequest("pop", "x"))


def test_a_phase_the_request_skips_still_has_its_overrides_checked():
    """A given score (or cot off) skips the abc phase, yet its abc_sampling is refused as for any song."""
    rules = p.SongRules(GenerationConfig(), ENC)
    for request in (SongRequest("pop", "la", abc="X:1\n"), SongRequest("pop", "la", cot="off")):
        with pytest.raises(ValueError, match=r"^abc_sampling: Sampling.max_tokens must be"):
            rules.check_request(request, abc_sampling={"max_tokens": p.CONTEXT + 1})
        rules.check_request(request, abc_sampling={"max_tokens": p.CONTEXT})


# --------------------------------------------------------------------------- a cover's transcription record


def _record(**changes) -> dict:
    import hashlib

    record = {"transcriber": "pyin", "transcriber_version": "pyin-1 (librosa 0.11.0)",
              "source": {"sha256": "ab" * 32, "bytes": 1234, "seconds": 9.6, "format": "WAV"}, "bpm": 100,
              "meter": "4/4", "key": "C", "warnings": [{"code": "drift", "message": "drift: ...", "figures": {}}],
              "licence": None, "score_sha256": hashlib.sha256(b"X:1\nK:C\nC|\n").hexdigest()}
    return {**record, **changes}


def test_a_transcription_record_is_kept_with_edited_worked_out_from_the_score():
    from yue2_vllm.protocol import check_transcription

    as_transcribed = SongRequest("pop", "la", cot="melody", abc="X:1\nK:C\nC|\n", transcription=_record())
    assert as_transcribed.transcription == {**_record(), "edited": False}
    edited = SongRequest("pop", "la", cot="melody", abc="X:1\nK:C\nD|\n", transcription=_record(edited=False))
    assert edited.transcription["edited"] is True  # a value sent is not used
    assert check_transcription(_record(), None)["edited"] is True  # no score given: not the transcribed one
    assert edited.to_dict()["transcription"] == edited.transcription
    assert "transcription" not in SongRequest("pop", "la").to_dict()
    assert SongRequest.from_dict(edited.to_dict()) == edited and hash(edited)


def test_a_transcription_records_whole_numbers_sent_as_floats_are_integers():
    """JSON Schema's integer is any number without a fraction (1.0 is one): such a number is kept as an integer."""
    given = _record(bpm=100.0, source={"sha256": "ab" * 32, "bytes": 1234.0, "seconds": 9.0})
    kept = SongRequest("pop", "la", cot="melody", abc="X:1\n", transcription=given).transcription
    assert (kept["bpm"], kept["source"]) == (100, {"sha256": "ab" * 32, "bytes": 1234, "seconds": 9.0})
    assert type(kept["bpm"]) is int and type(kept["source"]["bytes"]) is int
    with pytest.raises(ValueError, match=r"^SongRequest.transcription.source.bytes has the wrong type \(float\)"):
        SongRequest("pop", "la", cot="melody", abc="X:1\n",
                    transcription=_record(source={"sha256": "ab" * 32, "bytes": 1234.5}))


@pytest.mark.parametrize("value,words", [
    ([], "SongRequest.transcription must be an object"),
    (_record(notes=[]), r"SongRequest.transcription: unknown field\(s\) \['notes'\]"),
    ({k: v for k, v in _record().items() if k != "bpm"}, r"SongRequest.transcription: missing \['bpm'\]"),
    (_record(bpm=True), r"SongRequest.transcription.bpm has the wrong type \(bool\)"),
    (_record(bpm="100"), r"SongRequest.transcription.bpm has the wrong type \(str\)"),
    (_record(licence=3), r"SongRequest.transcription.licence has the wrong type"),
    (_record(score_sha256="AB" * 32), "SongRequest.transcription.score_sha256 must be 64 lowercase hex digits"),
    (_record(source={"sha256": "x"}), "SongRequest.transcription.source: needs its sha256"),
    (_record(source={"sha256": "ab" * 32, "path": "/tmp/a.wav"}),
     r"SongRequest.transcription.source: unknown field\(s\) \['path'\]"),
    (_record(source={"sha256": "ab" * 32, "seconds": "9"}), r"SongRequest.transcription.source.seconds has the "),
    (_record(warnings=["drift"]), r"SongRequest.transcription.warnings\[0\] must be an object \{code, message"),
    (_record(warnings=[{"code": "drift", "message": "m", "figures": {"at": float("nan")}}]),
     "SongRequest.transcription is not JSON-ready data"),
    (_record(licence="x" * 17000), "SongRequest.transcription is 17[0-9]{3} bytes of JSON, more than 16384"),
    (_record(key="\ud800"), "SongRequest.transcription is not JSON-ready data"),
])
def test_a_transcription_record_that_is_not_one_is_refused_naming_the_field(value, words):
    with pytest.raises(ValueError, match="^" + words):
        SongRequest("pop", "la", cot="melody", abc="X:1\n", transcription=value)
