"""Our C++ CPU kernels, compiled on first use with the machine's compiler.

They are built with `-march=native` for the CPU at hand (AVX-512 where there is
one) into `cache_root()/cpu_ops/<key>`, the key covering the sources, the torch
version and the CPU's feature flags, so a later process loads the built library
in milliseconds. Nothing here is required: `load()` returns False (and says why,
once, in the log) when there is no compiler, and callers keep the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
from pathlib import Path

import torch

from radixlm.utils import cache_root

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
SOURCES = [_DIR / f"{name}.cpp" for name in
           ("decode_attention", "elementwise", "extend_attention", "dense_gemm")]
HEADERS = [_DIR / "vec.h", _DIR / "attention.h"]
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(files: list[Path], cflags: list[str]) -> str:
    h = hashlib.sha256()
    for src in files:
        # The path too: ninja's build file names the sources, so two installs
        # of the same sources sharing a key would rebuild each other's library.
        h.update(str(src.resolve()).encode())
        h.update(src.read_bytes())
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def load() -> bool:
    """Build (once per machine) and load the kernels; True when they are usable
    as `torch.ops.radixlm_cpu.*`. Cheap after the first call (layers ask on
    every forward)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded


def _load() -> bool:
    # No fma contraction: attention rows must get the same bits in every kernel that
    # computes them (attention.h), so every fused multiply-add is written out.
    return build_extension("radixlm_cpu_ops", SOURCES, HEADERS,
                           ["-O3", "-march=native", "-ffp-contract=off"],
                           "using the torch attention path"
                           ) and hasattr(torch.ops.radixlm_cpu, "decode_attention")


# A build takes well under this; a lock older than it was left by a killed build,
# and torch would wait on it forever.
STALE_LOCK_SECONDS = 600


def _drop_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing %s, a build lock left %.0f s ago by a build that never "
                       "finished", lock, age)
        lock.unlink(missing_ok=True)


def build_extension(name: str, sources: list[Path], headers: list[Path], cflags: list[str],
                    fallback: str) -> bool:
    """Compile `sources` (with OpenMP) into `cache_root()/<name>/<key>` and load
    them into this process; False, after one warning naming `fallback` (what
    the caller does instead), when that fails."""
    from torch.utils import cpp_extension

    cflags = [*cflags, "-fopenmp"]
    build_dir = cache_root() / name.removeprefix("radixlm_") / _build_key(sources + headers,
                                                                           cflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    _drop_stale_lock(build_dir / "lock")
    try:
        cpp_extension.load(
            name=name, sources=[str(s) for s in sources], extra_cflags=cflags,
            extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False,
            verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported flags: keep the torch path
        lines = str(e).splitlines()
        why = next((ln for ln in lines if "error" in ln), lines[-1] if lines else "")
        logger.warning("CPU kernels %s unavailable (%s: %s); %s", name, type(e).__name__,
                       why.strip(), fallback)
        return False
    return True


def use_fused(x: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels serve `x`: half-precision CPU tensors
    (fp32 keeps torch's op chain, which HF's reference shares bit for bit), with
    the `operands` the kernel reads beside x (a norm's weight, a rotary cache)
    in x's dtype."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
            and all(o.dtype == x.dtype for o in operands) and load())


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     out: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     window: int | None = None, softcap: float | None = None) -> None:
    """out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b, where K_b/V_b are rows
    `req_to_token[req_pool_indices[b], :seq_lens[b]]` of the pool buffers
    (kv head h // (heads / kv_heads)); a request of length 0 gets zeros. q/out
    [bs, heads, dim], k/v [pool, kv_heads, dim], all one dtype, dim a multiple of
    16 up to 256. `window` W: only the last W tokens (the rows before them are not
    read); `softcap` c: scores become c * tanh(score / c). Each row's bits are the
    same whatever the batch, and equal `extend_attention`'s for the row at that
    position (attention.h)."""
    torch.ops.radixlm_cpu.decode_attention(q, k_buf, v_buf, out, req_to_token,
                                           req_pool_indices, seq_lens, scale,
                                           window or 0, softcap or 0.0)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     out: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None) -> None:
    """Causal attention of new tokens after cached ones, all read from the pool:
    request i (pool row `req_pool_indices[i]`) has `prefix_lens[i]` cached tokens
    and `extend_lens[i]` new ones, whose K/V are already stored; its new rows of
    q/out [tokens, heads, dim] follow request i - 1's (rows past the last
    request's are left untouched). The new token at position p attends to
    positions 0..p (with a window W, p - W + 1..p); `softcap` as in
    `decode_attention`, whose bits a row gets whatever the chunking, the cached
    prefix or the batch. All int64 index tensors are contiguous."""
    torch.ops.radixlm_cpu.extend_attention(q, k_buf, v_buf, out, req_to_token,
                                           req_pool_indices, prefix_lens, extend_lens, scale,
                                           window or 0, softcap or 0.0)


def dense_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [out, in] as `dense_linear` reads it (a copy: panels of 32
    output columns; fp32, or bf16 pairs on CPUs with AVX512-BF16)."""
    return torch.ops.radixlm_cpu.dense_pack(weight)


def dense_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x W^T (+ bias) for x [..., in] in x's dtype, W packed by `dense_pack`. Each
    output is one multiply-add chain over the input features in order, so a row's
    result is the same bits however many rows are multiplied with it."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = (x2.new_empty((x2.shape[0], out_features)) if out is None
         else out.view(x2.shape[0], out_features))
    torch.ops.radixlm_cpu.dense_linear(x2, packed, out_features, bias, y)
    return y.view(*x.shape[:-1], out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with `residual`, (norm(x + residual) * weight, x + residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    if residual is None:
        torch.ops.radixlm_cpu.rms_norm(x2, weight, eps, out)
        return out.view(shape)
    new_residual = torch.empty_like(x2)
    torch.ops.radixlm_cpu.fused_add_rms_norm(x2, residual.reshape(-1, shape[-1]), weight, eps,
                                             out, new_residual)
    return out.view(shape), new_residual.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(gate) * up."""
    x2 = x.reshape(-1, x.shape[-1])
    out = x2.new_empty((x2.shape[0], x2.shape[1] // 2))
    torch.ops.radixlm_cpu.silu_and_mul(x2, out)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def rope_(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor, head_dim: int,
          rotary_dim: int) -> torch.Tensor:
    """Neox-style RoPE of x [tokens, heads * head_dim] in place; cos_sin is
    [max_position, rotary_dim] = cat(cos, sin) in x's dtype."""
    torch.ops.radixlm_cpu.rope(positions, x, cos_sin, head_dim, rotary_dim)
    return x


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
             loc: torch.Tensor) -> None:
    """k_buf[loc] = k, v_buf[loc] = v for k/v [n, kv_heads * head_dim] and pools
    [size, kv_heads, head_dim] of the same dtype."""
    torch.ops.radixlm_cpu.store_kv(k, v, k_buf, v_buf, loc)
