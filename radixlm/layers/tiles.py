"""The grouped tile order shared by our Triton GEMMs (FP8, int4, invariant)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of output tile number `tile`, numbered in groups of
    GROUP_M tile rows: programs that run together share weight tiles in L2."""
    num_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    size_m = tl.minimum(tl.cdiv(M, BM) - first_m, GROUP_M)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m
