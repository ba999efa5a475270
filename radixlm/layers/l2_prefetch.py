"""Weights pulled into the GPU's L2 cache while small kernels keep DRAM idle.

Why: a decode step of a few rows reads every weight from DRAM once, and the
products of few rows are bandwidth-bound. Between a layer's qkv product and its
o_proj product run RoPE and attention, which at small batch read a few MB of
KV: on an H100 at one row the profile shows ~8 us a layer there with DRAM
nearly idle (BENCHMARKS.md, 2026-12-05). The small products pay most for DRAM's
ramp: FP8 qkv and o read their weights at 60-68 % of the copy rate, gate/up at
91 %. So after the qkv product a kernel on a side stream asks the L2 for the
weights of the products that come next (sm_90's `cp.async.bulk.prefetch.L2`:
a hint that moves no data into the SM and writes nothing), and those products
find them in L2.

What is asked for after a layer's qkv product (`--l2-prefetch`):
- `o`: the layer's o_proj weights (and an MoE layer's router, read next);
- `o+qkv`: also the next layer's qkv weights, with an evict-last policy, so
  they outlive the gate/up and down weights streaming through L2 meanwhile
  (the last layer asks for the first layer's, which the next decode step
  reads after the LM head and the sampling).
Tensors are taken in that order while they fit in BUDGET of the L2 (a bf16
o_proj of Llama-8B, 33.5 MB, does not fit an H100's 50 MB budget of 30), and
only for steps of at most MAX_ROWS rows (FP8's GEMV range; larger batches
spend longer in attention, and their products less on the weights' ramp).

The side stream forks from the current stream after the qkv product and joins
it at the end of the model's forward (`L2Prefetcher.join`). A CUDA graph
captures the prefetch as a branch off the main chain of kernels that nothing
on the chain waits for (that the chain's programmatic (PDL) edges survive the
fork is for the device to confirm: `benchmarks/l2_prefetch.py` and the end-to-end
runs with and without). The
prefetched addresses are taken from each layer's weight method at every issue
(`LinearMethod.decode_tensors`), so derived tensors that move after a weight
update are followed (the graphs are captured anew then).

Off by default: it has not yet been timed on a device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm.config import L2_PREFETCH_MODES
from radixlm.layers.moe.router import TopKRouter

try:  # CPU-only installs may lack Triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

MODES = L2_PREFETCH_MODES
MAX_ROWS = 32  # tokens of a step up to which it prefetches
BUDGET = 0.6  # share of the L2 that one prefetch may fill
CHUNK = 1 << 17  # bytes one program of the kernel asks for (32 lanes of 4 KiB)
LANES = 32
MIN_BYTES = 1 << 18  # smaller tensors (scales, biases) are not worth a launch
# The next layer's qkv under evict-last, to outlive the MLP's weights streaming
# past. Untimed either way: evict-last lines that were read may crowd the L2
# (the device's call compares both).
NEXT_EVICT_LAST = True


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the 16-byte aligned whole lines inside the memory that
    `t` (any strides) spans: what a bulk prefetch may ask for (its address and
    size must be multiples of 16)."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start, end = t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    first = -(-start // 16) * 16
    return first, max(0, (end - first) // 16 * 16)


def decode_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What a product of few rows reads of `module`: a linear layer's weight method
    names it; another module (a router) reads its own parameters."""
    method = getattr(module, "quant_method", None)
    if method is not None:
        return method.decode_tensors(module)
    return [p.data for p in module.parameters(recurse=False)]


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in decode_tensors(module))


@dataclass(frozen=True)
class PrefetchPoint:
    """What one layer asks for after its qkv product: each module's decode tensors,
    with (True) or without the evict-last policy."""

    modules: tuple[tuple[torch.nn.Module, bool], ...]

    def tensors(self) -> list[tuple[torch.Tensor, bool]]:
        return [(t, last) for module, last in self.modules for t in decode_tensors(module)
                if t.is_cuda and t.numel() * t.element_size() >= MIN_BYTES]


def plan(layers: Sequence[torch.nn.Module], mode: str, budget_bytes: int
         ) -> list[PrefetchPoint | None]:
    """Per decoder layer (each has `self_attn` with `qkv_proj` and `o_proj`, and
    `mlp`), what it asks for after its qkv product under `mode`: o_proj, then an
    MoE layer's router (read right after o_proj, in chains of dependent loads),
    then with "o+qkv" the next layer's qkv; None where nothing fits `budget_bytes`."""
    points: list[PrefetchPoint | None] = []
    for i, layer in enumerate(layers):
        wanted = [(layer.self_attn.o_proj, False)]
        router = getattr(layer.mlp, "gate", None)
        if isinstance(router, TopKRouter):
            wanted.append((router, False))
        if mode == "o+qkv":  # the last layer's next is the first of the next step
            wanted.append((layers[(i + 1) % len(layers)].self_attn.qkv_proj, NEXT_EVICT_LAST))
        chosen, used = [], 0
        for module, last in wanted:
            if used + nbytes(module) <= budget_bytes:
                chosen.append((module, last))
                used += nbytes(module)
        points.append(PrefetchPoint(tuple(chosen)) if chosen else None)
    return points


class L2Prefetcher:
    """Issues prefetches on a side stream of `device` (steps of up to MAX_ROWS rows)
    and joins that stream back (`join`, once a forward)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.pending = False

    def issue(self, point: PrefetchPoint, rows: int) -> None:
        if rows > MAX_ROWS:
            return
        tensors = point.tensors()
        if not tensors:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for t, evict_last in tensors:
                prefetch(t, evict_last)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.pending = False


def prefetch(t: torch.Tensor, evict_last: bool = False) -> None:
    """Ask the L2 for the memory `t` spans (`byte_span`), on the current stream:
    a program per CHUNK bytes, a 4 KiB bulk prefetch per lane."""
    address, size = byte_span(t)
    if size:
        _prefetch_kernel[(triton.cdiv(size, CHUNK),)](
            t, address - t.data_ptr(), size, CHUNK=CHUNK, LANES=LANES,
            PTX=EVICT_LAST_PTX if evict_last else PTX, num_warps=1)


# $1 the address, $2 the bytes (a multiple of 16; none where <= 0).
PTX = """{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}"""
EVICT_LAST_PTX = """{
.reg .pred p;
.reg .b64 policy;
setp.gt.s32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 policy, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;
mov.u32 $0, 0;
}"""

if HAS_TRITON:
    @triton.jit
    def _prefetch_kernel(base_ptr, head, size, CHUNK: tl.constexpr, LANES: tl.constexpr,
                         PTX: tl.constexpr):
        """Lane l of program p asks for bytes [p CHUNK + l CHUNK / LANES, + CHUNK /
        LANES) of the `size` from `base_ptr` + `head` (clipped at `size`)."""
        sub: tl.constexpr = CHUNK // LANES
        offset = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, LANES) * sub
        nbytes = tl.minimum(size - offset, sub).to(tl.int32)
        address = base_ptr.to(tl.int64, bitcast=True) + head + offset
        tl.inline_asm_elementwise(PTX, "=r,l,r", [address, nbytes], dtype=tl.int32,
                                  is_pure=False, pack=1)


def supported(device: torch.device) -> bool:
    """Bulk L2 prefetches need sm_90 (Hopper) or newer, and Triton."""
    if device.type != "cuda" or torch.version.hip or not HAS_TRITON:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def attach(layers: Sequence[torch.nn.Module], mode: str, device: torch.device
           ) -> tuple[L2Prefetcher | None, str]:
    """Give the decoder's layers (in order; `plan`'s) what their attention modules
    ask for after the qkv product under `mode` (each attention module's
    `l2_prefetch` slot); returns the prefetcher whose `join` ends a forward
    (None for "off") and what was set up, for the start-up log."""
    if mode not in MODES:
        raise ValueError(f"l2_prefetch={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return None, ""
    if not supported(device):
        raise ValueError(f"l2_prefetch={mode!r}: bulk L2 prefetches need an NVIDIA GPU of "
                         "compute capability 9.0 (Hopper) or newer")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    points = plan(layers, mode, int(BUDGET * l2))
    prefetcher = L2Prefetcher(device)
    for layer, point in zip(layers, points, strict=True):
        layer.self_attn.l2_prefetch = (None if point is None
                                       else functools.partial(prefetcher.issue, point))
    taken = sum(p is not None for p in points)
    return prefetcher, (f"L2 prefetch {mode}: {taken} of {len(points)} layers ask for their "
                        f"next weights after the qkv product (budget "
                        f"{BUDGET * l2 / 2**20:.0f} MiB, steps of up to {MAX_ROWS} rows)")
