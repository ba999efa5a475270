"""The all-reduce fused with add + RMSNorm (`radixlm.layers.allreduce_norm`) in one
process: world size 1, and a simulated world of two whose ranks run one after
the other (rank 1's flags are set by hand before rank 0 runs, which is what
rank 1's kernel would have done). The two-GPU test is in test_tp_gpu.py.

Needs CUDA, or the Triton interpreter on the CPU (`TRITON_INTERPRET=1`; its
bf16 rounding truncates, so there the comparison allows one bf16 step).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (HAS_CUDA or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from radixlm.layers.allreduce_norm import (  # noqa: E402
    FUSED_MAX_BYTES,
    MAX_PROGRAMS,
    AllReduceNorm,
)
from radixlm.layers.fused_ops import rms_norm_torch  # noqa: E402

DEV = torch.device("cuda" if HAS_CUDA else "cpu")
SLOT_BYTES = 1 << 17
CASES = [(1, 64, torch.bfloat16), (37, 100, torch.bfloat16), (40, 256, torch.float16),
         (3, 128, torch.float32), (300, 64, torch.bfloat16)]  # 300: more rows than programs


def _world(size: int) -> tuple[list[AllReduceNorm], list[torch.Tensor]]:
    bufs = [torch.zeros(2 * SLOT_BYTES, dtype=torch.uint8, device=DEV) for _ in range(size)]
    pads = [torch.zeros(MAX_PROGRAMS * size, dtype=torch.int32, device=DEV) for _ in range(size)]
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEV)
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64, device=DEV)
    return [AllReduceNorm(bufs[r], buf_ptrs, pad_ptrs, r, size) for r in range(size)], pads


def _assert_same(got: torch.Tensor, ref: torch.Tensor, exact: bool = False) -> None:
    """Within one rounding step of the dtype (the fused row sum and torch's mean
    reduce in different orders), or bit for bit with `exact` on CUDA (the
    interpreter's bf16/fp16 casts truncate)."""
    if exact and (HAS_CUDA or got.dtype == torch.float32):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
        return
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}[got.dtype]
    if not HAS_CUDA and got.dtype != torch.float32:
        tol *= 2.5  # the truncated residual's step, then the norm's
    torch.testing.assert_close(got, ref, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("rows,hidden,dtype", CASES)
def test_fused_matches_reduce_then_norm(world, rows, hidden, dtype):
    ranks, pads = _world(world)
    g = torch.Generator(device=DEV).manual_seed(rows)
    residual = torch.randn(rows, hidden, generator=g, device=DEV).to(dtype)
    weight = torch.randn(hidden, generator=g, device=DEV).to(dtype)
    for call in range(3):  # the slots alternate between calls
        parts = [torch.randn(rows, hidden, generator=g, device=DEV).to(dtype)
                 for _ in range(world)]
        xs = []
        for r, ar in enumerate(ranks):
            x = ar.buffer((rows, hidden), dtype)
            assert ar.slot_of(x) == call % 2
            x.copy_(parts[r])
            xs.append(x)
        programs = min(rows, MAX_PROGRAMS)
        if world == 2:
            pads[0].view(MAX_PROGRAMS, 2)[:programs, 1] = 1  # rank 1 arrived first
        outs = [ar(x, residual, weight, 1e-5) for ar, x in zip(ranks, xs)]
        if world == 2:  # every flag consumed but rank 1's to rank 0, set after rank 0 ran
            assert int(pads[1].sum()) == 0
            assert int(pads[0].view(MAX_PROGRAMS, 2)[:programs, 1].sum()) == programs
            pads[0].zero_()
        total = parts[0].float()
        for p in parts[1:]:
            total = total + p.float()
        ref_y, ref_res = rms_norm_torch(total.to(dtype), weight, 1e-5, residual)
        for y, new_res in outs:
            _assert_same(new_res, ref_res, exact=True)
            _assert_same(y, ref_y)
        assert world == 1 or torch.equal(outs[0][0], outs[1][0])
        residual = ref_res


def test_partial_outside_the_slots_is_staged():
    (ar,), _ = _world(1)
    x = torch.randn(5, 64, device=DEV)
    residual = torch.randn(5, 64, device=DEV)
    weight = torch.ones(64, device=DEV)
    y, new_res = ar(x, residual, weight, 1e-6)
    ref_y, ref_res = rms_norm_torch(x, weight, 1e-6, residual)
    _assert_same(new_res, ref_res)
    _assert_same(y, ref_y)
    assert ar.next_slot == 1  # it took a slot


def test_can_reduce_limits():
    (ar,), _ = _world(1)
    limit = min(SLOT_BYTES, FUSED_MAX_BYTES)
    assert ar.can_reduce((limit // 2 // 64, 64), torch.bfloat16)
    assert not ar.can_reduce((limit // 2 // 64 + 1, 64), torch.bfloat16)
    assert not ar.can_reduce((1, 64), torch.int32)
