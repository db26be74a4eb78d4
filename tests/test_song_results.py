"""What each stage hands the next: result.json's word on reproducibility."""
from yue2_vllm.song.results import BATCH_NOTE, batch_record

INVARIANT_AR = {"backend_actual": "vllm", "batch_invariant": True}
BATCHED_AR = {"backend_actual": "vllm", "batch_invariant": False}
NO_AR = {"seconds": 0.0, "output_tokens": 0, "external_prefix_tokens": 12}  # a given score, or cot off


def test_a_song_is_batch_invariant_when_every_phase_that_ran_the_ar_was():
    assert batch_record(INVARIANT_AR, INVARIANT_AR) == {"batch_invariant": True}
    assert batch_record(NO_AR, INVARIANT_AR) == {"batch_invariant": True}  # a plan without AR depends on no batch
    assert batch_record(NO_AR, BATCHED_AR) == {"batch_invariant": False, "batch_note": BATCH_NOTE}
    assert batch_record(INVARIANT_AR, {"backend_actual": "vllm"}) == {"batch_invariant": False,
                                                                      "batch_note": BATCH_NOTE}
    assert batch_record(None, INVARIANT_AR) == {"batch_invariant": True}
