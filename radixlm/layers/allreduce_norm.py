"""Tensor-parallel all-reduce fused with the residual add and RMSNorm that follow it.

Why: in a decoder layer each row-parallel projection (o_proj, down_proj) ends
in an all-reduce, and the next thing done with the sum is `x + residual` and
an RMSNorm. At tp=2 a Llama-8B decode step at batch 1 is 64 such pairs: the
all-reduce kernel copies the partial into a symmetric buffer, meets the peer,
sums and meets it again, and a second kernel adds and normalizes. Here the
projection writes its partial straight into the symmetric buffer, and one
kernel meets the peers once, sums, adds and normalizes.

Contract (`AllReduceNorm`):
- `buffer(shape, dtype)` hands out the next of two buffer slots, in symmetric
  memory (mapped into every rank's address space), for a row-parallel
  layer's output. Every rank asks in the same order (the model code is the
  same on every rank), so slot i is the same slot everywhere.
- `__call__(x, residual, weight, eps)` with x a tensor from `buffer` returns
  (rmsnorm(sum_ranks(x) + residual) * weight, sum_ranks(x) + residual),
  rounded as the unfused path rounds: the sum once to x's dtype (what the
  all-reduce returns), the new residual once, the norm computed from it in
  fp32. Every rank gets the same bits: ranks are summed in rank order.
- One launch, no host sync: safe inside CUDA graphs.

Synchronization: program b of each rank sets flag (b, rank) in each peer's
signal pad (compare-and-swap 0 -> 1, release, system scope) and waits for
each peer's flag (b, peer) in its own pad to turn 1, resetting it to 0
(acquire). The partials were written by an earlier kernel on each rank, so
after the wait every peer's whole partial is visible. There is no second
barrier before the slot may be written again: slots alternate, so a rank
rewrites call n's slot only in call n + 2, after call n + 1's barrier, which
each peer reaches only once its call-n kernel (which read the slot) is done.
"""

from __future__ import annotations

import math

import torch

from radixlm.layers import pdl

try:  # CPU-only installs may lack Triton; callers then reduce and normalize apart.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

# One row per program, up to this many rows (more loop in their programs).
# Every program of the grid waits for its twin on each peer, so the whole grid
# must fit on the GPU at once: 256 programs of <= 16 warps do. Flags used per
# rank: MAX_PROGRAMS * world_size 32-bit words of the signal pad.
MAX_PROGRAMS = 256
MAX_HIDDEN = 16384  # one program holds a whole row in registers
# Messages up to this size take the fused kernel (decode at up to 8 rows of
# hidden 4096: the GEMV regime). Measured on 2 x H200 in CUDA graphs, fused vs
# torch's one-shot all-reduce + our norm: 5.1 vs 8.4 us at 8 KB, 6.8 vs 8.7 at
# 64 KB, but 17.5 vs 12.9 at 512 KB and 55.5 vs 24.0 at 2 MB (with 32 or 256
# programs, .cg or volatile loads alike: not understood yet).
FUSED_MAX_BYTES = 64 << 10
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class AllReduceNorm:
    """Two symmetric-memory slots of `slot_bytes` each, and the fused kernel over them.

    `buffers` is a [2 * slot_bytes] uint8 tensor that every rank's peers can
    load from, `buffer_ptrs` / `pad_ptrs` int64 device tensors with each rank's
    address of its buffer and of its signal pad (zeroed at allocation), in
    rank order. `SymmMemAllReduce`-style setup lives in `radixlm.distributed`;
    tests may pass plain tensors of one process (world size 1, or a simulated
    world whose flags they set by hand).
    """

    def __init__(self, buffers: torch.Tensor, buffer_ptrs: torch.Tensor, pad_ptrs: torch.Tensor,
                 rank: int, world_size: int) -> None:
        assert buffers.dtype == torch.uint8 and buffers.numel() % 2 == 0
        self.buffers = buffers
        self.slot_bytes = buffers.numel() // 2
        self.buffer_ptrs, self.pad_ptrs = buffer_ptrs, pad_ptrs
        self.rank, self.world_size = rank, world_size
        self.next_slot = 0

    def can_reduce(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> bool:
        numel = math.prod(shape)
        return (HAS_TRITON and dtype in DTYPES and 0 < shape[-1] <= MAX_HIDDEN
                and numel * dtype.itemsize <= min(self.slot_bytes, FUSED_MAX_BYTES))

    def buffer(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next slot, as a tensor of `shape` (check `can_reduce` first)."""
        slot, self.next_slot = self.next_slot, self.next_slot ^ 1
        start = slot * self.slot_bytes
        raw = self.buffers[start:start + math.prod(shape) * dtype.itemsize]
        return raw.view(dtype).view(shape)

    def slot_of(self, x: torch.Tensor) -> int | None:
        """Which slot `x` is (None: not a whole slot from `buffer`)."""
        offset = x.data_ptr() - self.buffers.data_ptr()
        if offset % self.slot_bytes or not x.is_contiguous():
            return None
        slot = offset // self.slot_bytes
        return slot if slot in (0, 1) else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self.slot_of(x)
        if slot is None:  # a partial that is not in a slot: copy it into the next one
            staged = self.buffer(x.shape, x.dtype)
            staged.copy_(x)
            x, slot = staged, self.slot_of(staged)
        n = x.shape[-1]
        rows = x.numel() // n
        r2 = residual.reshape(rows, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if rows == 0:
            return y, new_res
        block = triton.next_power_of_2(n)
        programs = min(rows, MAX_PROGRAMS)
        _allreduce_add_rms_norm_kernel[(programs,)](
            self.buffer_ptrs, self.pad_ptrs, slot * (self.slot_bytes // x.element_size()),
            r2, weight, y, new_res, rows, n, r2.stride(0), eps,
            RANK=self.rank, WORLD=self.world_size, BLOCK=block,
            num_warps=max(1, min(16, block // 512)), **pdl.launch_args())
        return y, new_res


if HAS_TRITON:
    from radixlm.layers.pdl import pdl_trigger, pdl_wait

    @triton.jit
    def _allreduce_add_rms_norm_kernel(BufPtrs, PadPtrs, slot_offset, R, W, Y, RO, M, N,
                                       stride_r, eps, RANK: tl.constexpr, WORLD: tl.constexpr,
                                       BLOCK: tl.constexpr, PDL: tl.constexpr):
        # The wait comes before the barrier: meeting the peers says "my partial is
        # in the slot", which the previous kernel (the projection) writes.
        pdl_wait(PDL)
        pdl_trigger(PDL)
        pid = tl.program_id(0)
        # Meet every peer's program `pid` (see the module docstring).
        for p in tl.static_range(WORLD):
            if p != RANK:
                pad = tl.load(PadPtrs + p).to(tl.pointer_type(tl.int32))
                while tl.atomic_cas(pad + pid * WORLD + RANK, 0, 1, sem="release",
                                    scope="sys") != 0:
                    pass
        own_pad = tl.load(PadPtrs + RANK).to(tl.pointer_type(tl.int32))
        for p in tl.static_range(WORLD):
            if p != RANK:
                while tl.atomic_cas(own_pad + pid * WORLD + p, 1, 0, sem="acquire",
                                    scope="sys") != 1:
                    pass
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        for row in range(pid, M, tl.num_programs(0)):  # offsets fit int32: rows * N <= a slot
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for p in tl.static_range(WORLD):  # rank order on every rank: same bits everywhere
                part = tl.load(BufPtrs + p).to(tl.pointer_type(RO.dtype.element_ty))
                # .cg: from L2 / over NVLink, never a stale L1 line.
                acc += tl.load(part + slot_offset + row * N + offs, mask=mask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
            summed = acc.to(RO.dtype.element_ty).to(tl.float32)  # what the all-reduce returns
            r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            s = (summed + r).to(RO.dtype.element_ty)
            tl.store(RO + row * N + offs, s, mask=mask)
            sf = s.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(sf * sf, 0) / N + eps)
            tl.store(Y + row * N + offs, (sf * rstd * w).to(Y.dtype.element_ty), mask=mask)
