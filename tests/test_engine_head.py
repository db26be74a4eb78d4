"""The phase-sliced lm_head's parts, cost rule and arithmetic (`engine.head`), on plain torch kernels.

Integer-valued weights and hidden states keep every product exact in float32 whatever the summation order,
so the sliced logits are compared for equality with the full head's."""
import pytest
import torch
import torch.nn.functional as F

from yue2_vllm.engine import sampling as es
from yue2_vllm.engine.head import PhaseHead, choice_record, head_parts, phase_choices, slice_pays
from yue2_vllm.protocol import ABC_END, CODEC_OFFSET, CODEC_SIZE, MUSIC_END, VOCAB_SIZE

ABC, SEMANTIC = es.PHASE_INDEX["abc"], es.PHASE_INDEX["semantic"]


def test_the_head_is_cut_at_the_phase_slices_bounds():
    assert head_parts(VOCAB_SIZE) == ((0, ABC_END + 1), (ABC_END + 1, MUSIC_END), (MUSIC_END, CODEC_OFFSET + CODEC_SIZE),
                                      (CODEC_OFFSET + CODEC_SIZE, VOCAB_SIZE))
    assert head_parts(VOCAB_SIZE) == ((0, 151849), (151849, 151852), (151852, 184621), (184621, 184704))
    assert all(bounds in head_parts(VOCAB_SIZE) for bounds in es.PHASE_SLICES)  # each slice is one part
    assert head_parts(10, ((0, 4), (6, 10))) == ((0, 4), (4, 6), (6, 10))


def most_rows(share: float, hidden_size: int) -> int:
    rows = 0
    while slice_pays(share, hidden_size, rows + 1):
        rows += 1
        if rows > 10_000:
            return rows
    return rows


def test_a_slice_pays_when_its_skipped_rows_cost_more_than_its_copy():
    abc, semantic = 151849 / VOCAB_SIZE, 32769 / VOCAB_SIZE
    # (3s - 1)·m < (1 - s)·K: the abc slice below 0.12·K rows; the semantic slice (s < 1/3) at any row count.
    assert most_rows(abc, 2048) == 248 and most_rows(abc, 128) == 15
    assert most_rows(semantic, 128) > 10_000 and slice_pays(semantic, 1, 10**9)
    assert phase_choices(2048, VOCAB_SIZE, 64) == {ABC: True, SEMANTIC: True}
    assert phase_choices(128, VOCAB_SIZE, 16) == {ABC: False, SEMANTIC: True}
    assert choice_record(2048, VOCAB_SIZE, 248) == {"abc": "sliced", "semantic": "sliced"}
    assert choice_record(2048, VOCAB_SIZE, 249) == {"abc": "full head + mask", "semantic": "sliced"}
    assert choice_record(128, VOCAB_SIZE, 15) == {"abc": "sliced", "semantic": "sliced"}


def reference(hidden, weight, row_phases):
    """The full head's logits with each YuE2 row's columns outside its phase slice at −inf."""
    logits = F.linear(hidden, weight)
    for row, phase in enumerate(row_phases):
        if phase is not None:
            low, high = es.PHASE_SLICES[phase]
            logits[row, :low] = float("-inf")
            logits[row, high:] = float("-inf")
    return logits


def layout(row_phases):
    from yue2_vllm.engine.plugin import phase_layout

    return phase_layout(row_phases, torch.device("cpu"))


@pytest.mark.parametrize("full_kernel", [True, False], ids=["full-kept", "full-from-parts"])
@pytest.mark.parametrize("abc_sliced", [True, False], ids=["abc-sliced", "abc-full-masked"])
def test_every_choice_gives_the_full_heads_logits_on_each_rows_phase(full_kernel, abc_sliced):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-3, 4, (VOCAB_SIZE, 8), generator=generator).float()
    head = PhaseHead.over(weight, 4, lambda rows: lambda x: F.linear(x, rows))
    head.sliced = {ABC: abc_sliced, SEMANTIC: True}
    if not full_kernel:
        head.full = None  # the full head computed part by part
    calls = []
    head.parts = {bounds: (lambda kernel, bounds: lambda x: calls.append(bounds) or kernel(x))(kernel, bounds)
                  for bounds, kernel in head.parts.items()}
    for row_phases in ([SEMANTIC] * 3, [ABC] * 2, [None] * 2, [SEMANTIC, ABC, None, SEMANTIC, ABC],
                       [ABC, SEMANTIC]):
        hidden = torch.randint(-2, 3, (len(row_phases), 8), generator=generator).float()
        calls.clear()
        logits, widest = head.logits(hidden, layout(row_phases))
        assert logits.shape == (len(row_phases), VOCAB_SIZE) and torch.equal(logits, reference(hidden, weight,
                                                                                               row_phases))
        full_rows = None in row_phases or (ABC in row_phases and not abc_sliced)
        assert widest == (VOCAB_SIZE if full_rows else max(es.PHASE_SLICES[p][1] - es.PHASE_SLICES[p][0]
                                                           for p in set(row_phases)))
        if set(row_phases) == {SEMANTIC}:
            assert calls == [es.PHASE_SLICES[SEMANTIC]]  # one GEMM over the semantic rows only
        if not full_kernel and full_rows:
            assert set(calls) == set(head.parts)  # the full head, part by part


def test_a_slice_reads_only_its_rows():
    weight = torch.zeros(VOCAB_SIZE, 4)
    low, high = es.PHASE_SLICES[SEMANTIC]
    weight[:low] = float("nan")  # a read outside the slice would poison the logits
    weight[high:] = float("nan")
    head = PhaseHead.over(weight, 8, lambda rows: lambda x: F.linear(x, rows))
    logits, widest = head.logits(torch.ones(3, 4), layout([SEMANTIC] * 3))
    assert widest == high - low and not logits.isnan().any() and (logits[:, low:high] == 0).all()
