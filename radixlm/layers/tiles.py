"""What our Triton GEMMs (FP8, int4, invariant) share: the grouped tile order,
and whether operand tiles can come through TMA descriptors."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def grouped_tile(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of output tile number `tile`, numbered in groups of
    GROUP_M tile rows: programs that run together share weight tiles in L2."""
    num_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    size_m = tl.minimum(tl.cdiv(M, BM) - first_m, GROUP_M)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int) -> torch.cuda._CudaDeviceProperties:
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device) -> int:
    return _properties(_index(device)).multi_processor_count


def tma_fits(*tensors: torch.Tensor) -> bool:
    """TMA descriptors can read these 2-D operands: a Hopper-class device (sm_90
    and later; the Triton interpreter on the CPU emulates them), the last
    dimension contiguous, every row and the base on a 16-byte boundary."""
    t0 = tensors[0]
    if t0.is_cuda and _properties(_index(t0.device)).major < 9:
        return False
    if not t0.is_cuda and not INTERPRET:
        return False
    return all(t.stride(-1) == 1 and t.stride(0) * t.element_size() % 16 == 0
               and t.data_ptr() % 16 == 0 for t in tensors)
