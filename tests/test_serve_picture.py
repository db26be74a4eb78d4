"""The song's picture from its FLAC: peaks per channel and a log-frequency spectrogram, read in blocks."""
import base64

import numpy as np
import pytest
import soundfile

from yue2_vllm.artifacts import flac_bytes
from yue2_vllm.serve import picture
from yue2_vllm.serve.picture import COLUMNS, PEAK_BUCKETS, ROWS, song_picture


def lanes(document):
    return [np.frombuffer(base64.b64decode(lane), np.int8).reshape(-1, 2) for lane in document["peaks"]]


def levels(document):
    return np.frombuffer(base64.b64decode(document["spectrogram"]), np.uint8).reshape(COLUMNS, ROWS)


@pytest.fixture
def tone(tmp_path):
    """30 s: a 0.5 sine at 1 kHz on the left, silence on the right, then the left's second half at 0.25."""
    rate = 48000
    t = np.arange(30 * rate) / rate
    left = 0.5 * np.sin(2 * np.pi * 1000 * t)
    left[len(t) // 2:] *= 0.5
    path = tmp_path / "audio.flac"
    path.write_bytes(flac_bytes(np.stack([left, np.zeros_like(left)], axis=1).astype(np.float32)))
    return path


def test_peaks_follow_each_channel_and_the_spectrum_finds_the_tone(tone):
    document = song_picture(tone)
    assert document["duration"] == 30.0 and document["sample_rate"] == 48000 and document["buckets"] == PEAK_BUCKETS
    left, right = lanes(document)
    assert left.shape == right.shape == (PEAK_BUCKETS, 2) and not right.any()
    assert set(left[: PEAK_BUCKETS // 2 - 1].reshape(-1).tolist()) <= {-64, -63, 63, 64}  # ±0.5 × 127
    assert set(left[PEAK_BUCKETS // 2 + 1:].reshape(-1).tolist()) <= {-32, -31, 31, 32}
    bands = levels(document)
    edges = 40 * (24000 / 40) ** (np.arange(ROWS + 1) / ROWS)
    tone_band = int(np.searchsorted(edges, 1000) - 1)
    assert (bands.argmax(axis=1) == tone_band).all()  # every column's loudest band holds 1 kHz
    assert bands[: COLUMNS // 2 - 2, tone_band].min() == 255  # the loudest 80 dB, top at the louder half
    assert len(base64.b64decode(document["spectrogram"])) == COLUMNS * ROWS


def test_reading_in_blocks_gives_the_whole_files_picture(tone, monkeypatch):
    whole = song_picture(tone)
    monkeypatch.setattr(picture, "BLOCK_FRAMES", 1000)  # buckets and windows across many block edges
    assert song_picture(tone) == whole
    samples, _ = soundfile.read(tone, dtype="float32")
    buckets = np.arange(len(samples)) * PEAK_BUCKETS // len(samples)
    expected = [max(0.0, float(samples[buckets == b, 0].max())) for b in (0, 1000, 4095)]
    assert [lanes(whole)[0][b, 1] for b in (0, 1000, 4095)] == [round(v * 127) for v in expected]


def test_an_empty_or_mono_file(tmp_path):
    mono = tmp_path / "mono.flac"
    soundfile.write(mono, np.full(4800, 0.25, np.float32), 48000, format="FLAC", subtype="PCM_24")
    left, right = lanes(song_picture(mono))
    assert (left == right).all() and left[:, 1].max() == 32
