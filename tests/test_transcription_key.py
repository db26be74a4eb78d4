"""The key from the pitch classes (Krumhansl-Kessler), named as the score's K: field names it."""
import pytest

from yue2_vllm.score import KEYS
from yue2_vllm.transcription.key import MAJOR_KEYS, MINOR_KEYS, estimate_key

TWINKLE = [60, 60, 67, 67, 69, 69, 67, 65, 65, 64, 64, 62, 62, 60]


@pytest.mark.parametrize("pitches, weights, key", [
    (TWINKLE, [1] * 13 + [2], "C"),
    ([p + 7 for p in TWINKLE], [1] * 13 + [2], "G"),  # F# is in it
    ([p - 2 for p in TWINKLE], [1] * 13 + [2], "Bb"),
    ([57, 60, 64, 69, 68, 69, 71, 72, 71, 69, 64, 60, 57], [2, 1, 1, 2, 1, 1, 1, 1, 3, 1, 1, 1, 3], "Am"),
    ([66, 69, 73, 78, 77, 78, 73, 66], [2, 1, 1, 2, 1, 2, 1, 3], "F#m"),
])
def test_the_key_of_a_melody(pitches, weights, key):
    assert estimate_key(pitches, weights) == key


def test_one_pitch_class_or_none_names_a_major_key_on_it_or_c():
    assert estimate_key([62, 74, 62], [1, 1, 1]) == "D" and estimate_key([], []) == "C"


def test_every_name_is_a_key_the_score_takes():
    assert set(MAJOR_KEYS + MINOR_KEYS) <= set(KEYS)
