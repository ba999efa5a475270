"""Products with quantized weights on the CPU: our C++ kernels (`qgemm*.cpp`).

A weight is a `QuantizedWeight` in the tile layout of `qgemm.h` (built by
`qpack`); activations are quantized to int8 per block of 32 on the way in, as
llama.cpp does, and the products run in integer SIMD (AVX-512 VNNI, AVX-512,
AVX2) or portable C++. Every path gives the same bits, so the path is a
property of the machine, never of the result.

The library is compiled on first use without `-march=native`: each ISA path
is compiled for its own instruction set and picked at run time from what the
CPU reports, which is what lets a test force each one (`isa=`) and the
`RADIXLM_QGEMM_ISA` environment variable pin one for a process.

Threads: products run on a small pool of our own (`qgemm_pool.h`: torch's
thread count, or the count `torch_ops_on_one_thread` pins while torch's own
ops run on one thread; spinning for the next product up to 1 ms, then asleep;
decode attention's units run there too), not on
torch's OpenMP threads, where those sleep when idle (OMP_WAIT_POLICY=PASSIVE,
radixlm's default; with spinning OpenMP threads, the threading before it);
`set_threading` (or `RADIXLM_QGEMM_POOL_ROWS` / `RADIXLM_QGEMM_SPIN_US`)
changes that, for A/B runs. The thread count never changes a result's bits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from radixlm.layers.cpu_ops import build_extension

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
SOURCES = [_DIR / f"{name}.cpp" for name in
           ("qgemm", "qgemm_portable", "qgemm_avx2", "qgemm_avx512", "qgemm_avx512_vnni")]
HEADERS = [_DIR / "qgemm.h", _DIR / "qgemm_avx512.inc", _DIR / "qgemm_pool.h"]
# No fma contraction: the paths compute the same bits only if each keeps the
# multiplies and adds as written.
_CFLAGS = ["-O3", "-ffp-contract=off"]

# Fastest last; the index is the C++ `Isa` code.
ISAS = ("portable", "avx2", "avx512", "avx512_vnni")
FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "int8")
ISA_ENV = "RADIXLM_QGEMM_ISA"
POOL_ROWS_ENV = "RADIXLM_QGEMM_POOL_ROWS"
SPIN_US_ENV = "RADIXLM_QGEMM_SPIN_US"
ACT_BLOCK = 32  # activation values per int8 scale; weights' k is a multiple of it

_lock = threading.Lock()
_loaded: bool | None = None


def load() -> bool:
    """Build (once per machine) and load the kernels; True when usable."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                loaded = build_extension("radixlm_qgemm", SOURCES, HEADERS, _CFLAGS,
                                         "quantized weights are unavailable")
                if loaded:
                    torch.ops.radixlm_q.set_threading(_default_pool_rows(),
                                                      int(os.environ.get(SPIN_US_ENV, -1)))
                    _share_pool()
                _loaded = loaded
    return _loaded


def _share_pool() -> None:
    """Decode attention (the other extension, `cpu_ops`) runs its units on this
    pool's workers from now on: they spin between the products around it, where
    torch's OpenMP threads sleep and wake too slowly for ~100 us of work."""
    from radixlm.layers import cpu_ops

    if cpu_ops.load():
        torch.ops.radixlm_cpu.set_pool(torch.ops.radixlm_q.pool_entry())


def _default_pool_rows() -> int:
    """$RADIXLM_QGEMM_POOL_ROWS, else every size (-1: the C++ default) where
    torch's OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE, which
    radixlm sets unless told otherwise), else none (0: the threading before the
    pool). OpenMP threads that spin after each parallel region hold the second
    core against our workers: model pass, 2 threads, OMP_WAIT_POLICY=ACTIVE, ms,
    pool vs OpenMP at M = 8 18.5 vs 10.2, 32: 42.2 vs 25.8, 256: 309 vs 208;
    below 8 rows the pool vs the calling thread alone was faster in one run
    (M = 1 7.9 vs 9.1, 2: 9.4 vs 11.5) and slower in the next (M = 2 10.7 vs
    7.9, 4: 10.6 vs 9.6): no gain to count on. Where torch was imported before
    radixlm the variable reads PASSIVE but OpenMP spins (`radixlm.OMP_BUSY_WAIT`);
    the pool stays on there, as decode measured it faster (GGUF MoE, 3
    processes each: 67-75 tok/s against 58-62 with RADIXLM_QGEMM_POOL_ROWS=0)."""
    if POOL_ROWS_ENV in os.environ:
        return int(os.environ[POOL_ROWS_ENV])
    return -1 if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" else 0


def set_threading(pool_rows: int | None = None, spin_us: int | None = None) -> tuple[int, int]:
    """Products of fewer than `pool_rows` rows run on our pool (default: all under
    OMP_WAIT_POLICY=PASSIVE, else none, see `_default_pool_rows`; 0:
    none, the threading before the pool: fewer than 8 rows on the calling thread
    alone, more on torch's OpenMP threads); pool workers spin `spin_us`
    microseconds (default 1000) for the next product before they sleep. None
    keeps a value; returns (pool_rows, spin_us) now."""
    return tuple(_ops().set_threading(-1 if pool_rows is None else pool_rows,
                                      -1 if spin_us is None else spin_us))


@contextlib.contextmanager
def torch_ops_on_one_thread() -> Iterator[None]:
    """Inside: torch's own ops (and our other kernels' at::parallel_for) on the
    calling thread alone, while the products (and decode attention's units) keep
    the pool with the threads torch had. For decode-sized steps under the
    passive OpenMP policy, where a parallel op of a few microseconds' work waits
    for a sleeping OpenMP thread to wake: alone, 2 threads against one, a [1,
    49152] bf16 -> fp32 copy took 57 against 10 us and a [1, 2048] x [2048, 64]
    bf16 product 162 against 44 us. Not re-entrant across threads: the
    scheduler's one forward at a time."""
    threads = torch.get_num_threads()
    if threads < 2 or not load():
        yield
        return
    ops = torch.ops.radixlm_q
    ops.pin_pool_threads(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        ops.pin_pool_threads(0)


def _ops() -> object:
    if not load():
        raise RuntimeError("the quantized-weight CPU kernels could not be built (see the "
                           "warning above): a C++ compiler and ninja are needed")
    return torch.ops.radixlm_q


def available_isas() -> list[str]:
    """The ISA paths this CPU and build run, slowest first."""
    return list(_available_isas()) if load() else []


@functools.cache
def _available_isas() -> tuple[str, ...]:
    # Asked once: every product with an explicit isa= checks it, and four op
    # calls cost ~5 us of a 20-100 us decode-sized product.
    return tuple(name for i, name in enumerate(ISAS) if torch.ops.radixlm_q.isa_supported(i))


@functools.cache
def _default_isa() -> int:
    name = os.environ.get(ISA_ENV)
    if not name:
        return ISAS.index(available_isas()[-1])
    return _isa_code(name)


def _isa_code(name: str | None) -> int:
    if name is None:
        return _default_isa()
    if name not in ISAS:
        raise ValueError(f"isa={name!r}: expected one of {', '.join(ISAS)}")
    if not load() or name not in _available_isas():
        raise ValueError(f"isa={name!r} is not available on this CPU (available: "
                         f"{', '.join(available_isas()) or 'none'})")
    return ISAS.index(name)


def default_isa() -> str:
    """The path products take unless told otherwise: $RADIXLM_QGEMM_ISA, else the fastest."""
    return ISAS[_default_isa()]


@dataclass(frozen=True)
class QuantizedWeight:
    """W [n, k] in the kernels' tile layout (`qgemm.h`). `k` is a multiple of 32;
    `in_features` (<= k) is what callers pass (int8 pads k up with zeros)."""

    format: str
    n: int
    k: int
    in_features: int
    qweight: torch.Tensor  # uint8, flat
    scales: torch.Tensor   # float16 or float32, flat
    mins: torch.Tensor     # same dtype as scales; empty for symmetric formats

    @property
    def format_code(self) -> int:
        return FORMATS.index(self.format)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))


def _rows(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {w.in_features}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantized products take float32 or bfloat16 input, got {x.dtype}")
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if w.k != w.in_features:
        x2 = F.pad(x2, (0, w.k - w.in_features))
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(x: torch.Tensor, w: QuantizedWeight, isa: str | None = None) -> torch.Tensor:
    """x W^T for x [..., in_features] (float32 or bfloat16), in x's dtype."""
    x2 = _rows(x, w)
    out = _ops().linear(x2, w.qweight, w.scales, w.mins, w.format_code, w.n,
                                     _isa_code(isa))
    # Views cost ~1 us each of a decode-sized product: none for 2-D input.
    return out if x.dim() == 2 else out.view(*x.shape[:-1], w.n)


@dataclass(frozen=True)
class QuantizedActivations:
    """x quantized once for several products (`gemm_into`)."""

    q: torch.Tensor
    d: torch.Tensor
    sum16: torch.Tensor
    dsum: torch.Tensor


def quantize_activations(x: torch.Tensor, w: QuantizedWeight,
                         isa: str | None = None) -> QuantizedActivations:
    """x [..., in_features] quantized for products with weights shaped like `w`."""
    return QuantizedActivations(*_ops().quantize_act(_rows(x, w), _isa_code(isa)))


def gemm_into(act: QuantizedActivations, w: QuantizedWeight, out: torch.Tensor,
              isa: str | None = None) -> None:
    """out[:, :] = x W^T, out a [rows, n] view (float32 or bfloat16) whose last dim
    is contiguous: a column slice of a wider output works."""
    _ops().gemm(act.q, act.d, act.sum16, act.dsum, w.qweight, w.scales, w.mins,
                             w.format_code, w.n, out, _isa_code(isa))


def grouped_linear(x: torch.Tensor, weights: list[QuantizedWeight],
                   isa: str | None = None) -> torch.Tensor:
    """[len(weights), n]: row e is x[e] W_e^T (x [len(weights), k]), or x[0] W_e^T
    (x [1, k]): one token's routed experts, one call, one pool job. The weights
    share their format and shape; the rows are x's dtype, bit for bit what
    `linear` gives row by row."""
    w0 = weights[0]
    x2 = _rows(x, w0)
    out = x2.new_empty(len(weights), w0.n)
    _ops().grouped_linear(x2, [w.qweight for w in weights], [w.scales for w in weights],
                          [w.mins for w in weights], w0.format_code, w0.n, out,
                          _isa_code(isa))
    return out


def dequantize(w: QuantizedWeight, rows: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W[rows] ([len(rows), in_features]; all of W without `rows`) in `dtype`, the
    values gguf's dequantization gives, bit for bit (before a bf16 rounding)."""
    if rows is None:
        rows = torch.arange(w.n)
    flat = rows.reshape(-1).to(torch.int64)
    out = _ops().dequantize(w.qweight, w.scales, w.mins, w.format_code, w.n, w.k,
                                         flat, dtype)
    return out[:, :w.in_features].reshape(*rows.shape, w.in_features)
