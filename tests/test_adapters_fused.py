"""Fused qkv / gate_up factors split by rows, exactly; a block-diagonal fusion keeps each part's own rank."""
import pytest
import torch

from yue2_vllm.adapters.fused import split_pair, split_rows


def test_a_block_diagonal_qkv_splits_to_each_parts_own_rank_exactly():
    g = torch.Generator().manual_seed(0)
    factors = [(torch.randn(4, 16, generator=g), torch.randn(rows, 4, generator=g)) for rows in (8, 4, 4)]
    a, b = torch.cat([f[0] for f in factors]), torch.block_diag(*[f[1] for f in factors])
    parts = split_pair(a, b, [8, 4, 4])
    for (pa, pb), (fa, fb) in zip(parts, factors):
        assert torch.equal(pa, fa) and torch.equal(pb, fb)
    full = b @ a
    assert torch.equal(torch.cat([pb @ pa for pa, pb in parts]), full)


def test_a_shared_a_keeps_the_whole_rank():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 16, generator=g), torch.randn(12, 3, generator=g)
    parts = split_pair(a, b, [6, 6])
    assert [p[0].shape[0] for p in parts] == [3, 3]
    assert torch.equal(torch.cat([pb @ pa for pa, pb in parts]), b @ a)


def test_a_zero_part_keeps_its_rows():
    a, b = torch.ones(2, 4), torch.zeros(6, 2)
    parts = split_pair(a, b, [3, 3])
    assert all(pa.shape == (2, 4) and pb.shape == (3, 2) for pa, pb in parts)


def test_rows_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match="fused lora_B has 10 rows, the fused projections have 12"):
        split_pair(torch.ones(2, 4), torch.ones(10, 2), [6, 6])
    with pytest.raises(ValueError, match="fused delta has 5 rows"):
        split_rows(torch.ones(5, 4), [3, 3])
    assert split_rows(None, [3, 3]) == [None, None]
    assert [t.shape[0] for t in split_rows(torch.ones(6), [2, 4])] == [2, 4]
