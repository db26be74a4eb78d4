"""The source audio: what libsndfile reads, hashed as given and mixed to mono; bad audio refused in one line naming
the problem (field "audio"), before any analysis."""
import hashlib
import io

import numpy as np
import pytest
import soundfile

from yue2_vllm.transcription import audio as audio_module
from yue2_vllm.transcription.audio import MIN_SECONDS, SILENCE_DBFS, read_audio, source_bytes
from yue2_vllm.transcription.result import TranscriptionError

RATE = 16000


def tone(seconds=2.0, rate=RATE, amplitude=0.3, channels=1):
    t = np.arange(int(seconds * rate)) / rate
    mono = (amplitude * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return mono if channels == 1 else np.stack([mono, 0.5 * mono], axis=1)


def encoded(samples, rate=RATE, format="WAV", subtype=None):
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=format, subtype=subtype)
    return buffer.getvalue()


@pytest.mark.parametrize("format, subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_24"), ("OGG", "VORBIS"),
                                             ("MP3", "MPEG_LAYER_III"), ("AIFF", "PCM_16"), ("WAV", "FLOAT")])
def test_what_libsndfile_reads_is_read_and_hashed_as_given(format, subtype):
    data = encoded(tone(), format=format, subtype=subtype)
    audio = read_audio(data, max_seconds=10)
    assert audio.info.sha256 == hashlib.sha256(data).hexdigest() and audio.info.bytes == len(data)
    assert (audio.info.format, audio.info.subtype, audio.info.sample_rate, audio.info.channels) == \
        (format, subtype, RATE, 1)
    assert audio.samples.dtype == np.float32 and audio.samples.ndim == 1
    assert audio.info.seconds == pytest.approx(2.0, abs=0.1) and audio.info.peak_dbfs == pytest.approx(
        20 * np.log10(0.3), abs=0.6)


def test_channels_are_mixed_to_mono_and_paths_and_files_read_like_bytes(tmp_path):
    stereo = tone(channels=2)
    data = encoded(stereo, subtype="FLOAT")
    path = tmp_path / "hum.wav"
    path.write_bytes(data)
    from_bytes, from_path = read_audio(data, max_seconds=10), read_audio(path, max_seconds=10)
    with open(path, "rb") as handle:
        from_file = read_audio(handle, max_seconds=10)
    assert from_bytes.info == from_path.info == from_file.info and from_bytes.info.channels == 2
    assert np.array_equal(from_bytes.samples, stereo.mean(axis=1, dtype=np.float32))
    assert np.array_equal(from_path.samples, from_file.samples)
    assert source_bytes(memoryview(data)) == data


def refusal(source, max_seconds=10.0) -> str:
    with pytest.raises(TranscriptionError) as caught:
        read_audio(source, max_seconds=max_seconds)
    assert caught.value.field == "audio" and "\n" not in str(caught.value)
    return str(caught.value)


def test_bad_audio_is_refused_in_one_line_naming_the_problem(tmp_path):
    assert refusal(b"") == "audio: the file is empty (0 bytes)"
    assert refusal(b"title,artist\nhum,me\n").startswith("audio: not audio libsndfile reads (")
    assert refusal(encoded(tone(0.5))) == f"audio: 0.50 s is too short (at least {MIN_SECONDS:g} s)"
    assert refusal(encoded(tone(3.0)), max_seconds=2.5) == \
        "audio: 3.0 s is too long (at most 2.5 s for this transcriber)"
    assert refusal(encoded(np.zeros(RATE * 2, np.float32))) == \
        f"audio: silent (its loudest sample is -inf dBFS, below {SILENCE_DBFS:g} dBFS)"
    assert refusal(encoded(tone(amplitude=10 ** (-70 / 20)), subtype="FLOAT")) == \
        f"audio: silent (its loudest sample is -70.0 dBFS, below {SILENCE_DBFS:g} dBFS)"
    broken = tone()
    broken[100] = np.nan
    assert refusal(encoded(broken, subtype="FLOAT")) == \
        "audio: holds samples that are not finite numbers (NaN or infinity)"
    assert refusal(tmp_path / "missing.wav").startswith(f"audio: cannot read '{tmp_path / 'missing.wav'}'")
    assert refusal(12345) == "audio: expected a file path, bytes or a binary file, got int"


def test_a_file_past_the_size_limit_is_refused_before_it_is_read(monkeypatch, tmp_path):
    monkeypatch.setattr(audio_module, "MAX_BYTES", 1000)
    path = tmp_path / "big.wav"
    path.write_bytes(encoded(tone()))
    limit = f"larger than {1000 / 2 ** 20:g} MiB"
    assert refusal(path) == f"audio: the file is {path.stat().st_size / 2 ** 20:.1f} MiB, {limit}"
    assert refusal(path.read_bytes()) == f"audio: the file is {path.stat().st_size / 2 ** 20:.1f} MiB, {limit}"
    with open(path, "rb") as handle:
        assert refusal(handle) == f"audio: the file is {limit}"
        assert handle.tell() == 1001  # read no further than the limit


def test_a_source_that_would_decode_past_what_is_read_is_refused_from_its_header():
    # 6 KB of FLAC at 655,350 Hz in 8 channels: 1.1 s of it decodes to 22 MiB (350 s of it to 7.3 GB)
    flac = encoded(np.zeros((int(655350 * 1.1), 8), np.float32), rate=655350, format="FLAC")
    assert len(flac) < 10_000
    assert refusal(flac) == "audio: its sample rate is 655350 Hz, above 192000 Hz (the highest read)"
    assert refusal(encoded(np.full((int(8000 * 1.5), 9), 0.1, np.float32), rate=8000)) == \
        "audio: it has 9 channels, more than 8 (the most read)"
    # 1.5 s of 48 kHz 8-channel audio against a 2 s limit: 576,000 samples, past 2 s of 96 kHz stereo (384,000)
    assert refusal(encoded(np.full((72000, 8), 0.1, np.float32), rate=48000), max_seconds=2.0) == \
        "audio: 72000 frames of 8 channels at 48000 Hz decode to 2 MiB, more than the 1 MiB read (2 s of 96 kHz " \
        "stereo)"
    for rate, channels in ((192000, 1), (96000, 2)):  # what the limit holds: a 192 kHz master, 96 kHz stereo
        source = read_audio(encoded(tone(1.5, rate=rate, channels=channels), rate=rate), max_seconds=2.0).info
        assert (source.sample_rate, source.channels) == (rate, channels)


def test_the_samples_are_decoded_once_and_checked_without_a_copy_of_them():
    import tracemalloc

    four = np.repeat(tone(3.0, rate=48000)[:, None], 4, axis=1)
    data = encoded(four, rate=48000, subtype="FLOAT")
    decoded = four.nbytes
    tracemalloc.start()
    try:
        audio = read_audio(data, max_seconds=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the decoded frames and their mono mix (a quarter of them); a whole-size copy (np.abs) would pass 2x
    assert peak < 1.5 * decoded and audio.info.peak_dbfs == pytest.approx(20 * np.log10(0.3), abs=0.01)
