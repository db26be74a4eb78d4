"""ComfyUI's fused `qkv_proj` / `gate_up_proj` factors split back onto the separate projections, exactly.

A fused pair's delta restricted to the rows of one projection is `B[rows] @ A`: exact for a shared A. Where
`B[rows]` is zero outside a contiguous band of columns (the block-diagonal fusions trainers write: rank 3×r
for qkv), only that band of columns of B and rows of A carry anything, and the part keeps just those: the
same delta at rank r, not 3r, so vLLM pads it to a smaller `max_lora_rank`. A `.diff` delta splits by rows.
"""
from __future__ import annotations

import torch


def split_pair(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(a, b)` per part of a fused pair, `b`'s rows split by `sizes`; each part keeps only the band of rank
    columns where its rows of `b` are not zero (all of them when its rows are all zero)."""
    if b.shape[0] != sum(sizes):
        raise ValueError(f"fused lora_B has {b.shape[0]} rows, the fused projections have {sum(sizes)}")
    parts, start = [], 0
    for size in sizes:
        rows = b[start:start + size]
        start += size
        used = torch.nonzero(rows.ne(0).any(dim=0)).flatten()
        if len(used) and (used[0] > 0 or used[-1] < b.shape[1] - 1):
            first, last = int(used[0]), int(used[-1]) + 1
            parts.append((a[first:last], rows[:, first:last]))
        else:
            parts.append((a, rows))
    return parts


def split_rows(tensor: torch.Tensor | None, sizes: list[int]) -> list[torch.Tensor | None]:
    """A fused `.diff` (weight `[sum(sizes), in]` or bias `[sum(sizes)]`) per part."""
    if tensor is None:
        return [None] * len(sizes)
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"fused delta has {tensor.shape[0]} rows, the fused projections have {sum(sizes)}")
    return list(tensor.split(sizes, dim=0))
