"""Weights asked of the GPU's L2 cache ahead of the products that read them.

Why: a decode step of a few rows reads every weight from DRAM once, and its
products are bandwidth-bound but keep too few bytes in flight to reach the copy
rate: on an H100 FP8 qkv and o read at 60-68 % of it, and o_proj runs in 5.4 us
with its weights in L2 against 8.8 from DRAM. Between products run small
kernels (RoPE, attention, norms, the split-K sums) with DRAM nearly idle. So
once a product is enqueued, a kernel on a side stream asks the L2 for the
weights of a product that follows (sm_90's `cp.async.bulk.prefetch.L2`, a hint
that moves no data into an SM and writes nothing). `benchmarks/l2_prefetch.py`
(BENCHMARKS.md, 2026-12-05) showed it filling the L2 only partly within an
8 us window, and speeding the large products by 9-22 %: it keeps going while
the product runs, with more bytes in flight than the product's warps.

What is asked for (`--l2-prefetch`, `plan`):
- `o`: after qkv, the layer's o_proj (and an MoE layer's router);
- `o+qkv`: also the next layer's qkv, evict-last, to outlive the MLP's weights
  streaming past; both within BUDGET of the L2;
- `all`: after each product the next one's weights (o_proj, gate/up, down,
  the next layer's qkv), each up to CAP times the L2 (past that the prefetch
  and the product fight over DRAM: bf16 gate/up lost 19 %).
Only for steps of at most MAX_ROWS rows (FP8's GEMV range).

The hooks are forward hooks (`install`): a product's module issues its point
after its forward, and the decoder stack joins the side stream after its own.
A CUDA graph captures each prefetch as a branch off the main chain that
nothing on the chain waits for. The addresses come from each layer's weight
method at every issue (`LinearMethod.decode_tensors`), so derived tensors that
move after a weight update are followed (the graphs are captured anew then).

Off by default: end to end it has not yet been measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
CAP = 2.5  # "all": a product's weights past this many times the L2 are not asked for
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
    """What the forward of `after` asks for once it is enqueued: each module's
    decode tensors, with (True) or without the evict-last policy."""

    after: torch.nn.Module
    modules: tuple[tuple[torch.nn.Module, bool], ...]

    def tensors(self) -> list[tuple[torch.Tensor, bool]]:
        return [(t, last) for module, last in self.modules for t in decode_tensors(module)
                if t.is_cuda and t.numel() * t.element_size() >= MIN_BYTES]


def plan(layers: Sequence[torch.nn.Module], mode: str, l2_bytes: int) -> list[PrefetchPoint]:
    """What the products of the decoder `layers` (each has `self_attn` with
    `qkv_proj` and `o_proj`, and `mlp`) ask for under `mode`, in forward order:
    - "o" / "o+qkv": after qkv, o_proj, an MoE layer's router (read right after
      o_proj, in chains of dependent loads), and with "o+qkv" the next layer's
      qkv; what passes BUDGET of `l2_bytes` is left out;
    - "all": after each product the next one's weights (qkv -> o_proj (+ router),
      o_proj -> gate/up, gate/up -> down, down -> the next layer's qkv; a MoE
      layer's experts are not known before its router), each left out past CAP
      times `l2_bytes`.
    The last layer's next qkv is the first layer's, of the next decode step."""
    points = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        next_qkv = layers[(i + 1) % len(layers)].self_attn.qkv_proj
        router = getattr(mlp, "gate", None)
        wanted = [(attn.o_proj, False), *([(router, False)] if isinstance(router, TopKRouter)
                                          else [])]
        if mode == "o+qkv":
            wanted.append((next_qkv, NEXT_EVICT_LAST))
        each = mode == "all"
        points.append(_point(attn.qkv_proj, wanted, (CAP if each else BUDGET) * l2_bytes, each))
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if mode == "all" and gate_up is not None and down is not None:
            points += [_point(attn.o_proj, [(gate_up, False)], CAP * l2_bytes, True),
                       _point(gate_up, [(down, False)], CAP * l2_bytes, True),
                       _point(down, [(next_qkv, False)], CAP * l2_bytes, True)]
    return [p for p in points if p.modules]


def _point(after: torch.nn.Module, wanted: list[tuple[torch.nn.Module, bool]], limit: float,
           each: bool) -> PrefetchPoint:
    """`wanted` in order while their bytes stay within `limit` (`each`: every
    module alone within it)."""
    chosen, used = [], 0
    for module, last in wanted:
        size = nbytes(module)
        if (size if each else used + size) <= limit:
            chosen.append((module, last))
            used += size
    return PrefetchPoint(after, tuple(chosen))


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


def attach(decoder: torch.nn.Module, layers: Sequence[torch.nn.Module], mode: str,
           device: torch.device) -> str:
    """Set up `mode` for a decoder stack (`decoder`, whose forward runs `layers`):
    each product of `plan` asks for what follows it once it is enqueued, and the
    side stream joins back when the stack's forward returns. Returns what was set
    up, for the start-up log ('' for "off")."""
    if mode not in MODES:
        raise ValueError(f"l2_prefetch={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return ""
    if not supported(device):
        raise ValueError(f"l2_prefetch={mode!r}: bulk L2 prefetches need an NVIDIA GPU of "
                         "compute capability 9.0 (Hopper) or newer")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    points = plan(layers, mode, l2)
    install(decoder, points, L2Prefetcher(device))
    return (f"L2 prefetch {mode}: {len(points)} products ask for the weights that follow "
            f"them (L2 {l2 / 2**20:.0f} MiB, steps of up to {MAX_ROWS} rows)")


def install(decoder: torch.nn.Module, points: Sequence[PrefetchPoint], prefetcher: Any) -> None:
    """Forward hooks: each point's module issues it (with the rows of its input)
    after its forward; `decoder` joins the prefetcher's stream after its own."""
    for point in points:
        point.after.register_forward_hook(
            lambda module, args, out, point=point: prefetcher.issue(point, args[0].shape[0]))
    decoder.register_forward_hook(lambda module, args, out: prefetcher.join())
