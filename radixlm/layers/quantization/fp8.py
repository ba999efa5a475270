"""FP8 (e4m3) weights: quantized at load (`--quantization fp8` on a float
checkpoint) or as a checkpoint ships them.

Formats (`Fp8Scheme`: where the scales are and what they are called):
- online: a float checkpoint, one scale per output row (max |row| / 448,
  over the whole row even where a tensor-parallel rank holds some of its
  columns); activations scaled per token at run time.
- HF `quant_method: fp8` with `weight_block_size: [bn, bk]` (DeepSeek-V3,
  Qwen3-FP8): `weight_scale_inv`, one float per [bn, bk] block of the weight
  (ceil at ragged edges; the name notwithstanding, a multiplier: w = q * s);
  activations scaled per token and group of bk (dynamic), or by one
  `activation_scale` (static).
- HF `quant_method: fp8` without blocks (AutoFP8's layout, as vLLM reads it):
  one `weight_scale` per tensor (so one per fused part), an `input_scale`
  per tensor when activations are static.
- compressed-tensors FP8 (`compressed_tensors.py`): `weight_scale` per tensor,
  per channel ([out, 1]) or per block, `input_scale` when static.

A MoE layer's experts take the same schemes (`fp8_moe.py`, from
`Fp8Config.get_moe_method`), with weight-only products.

Products (`Fp8LinearMethod.apply`): on CUDA in bf16/fp16, few rows go through
our FP8 GEMV (weights read once and multiplied at the activations' precision):
1-32 rows on the tensor cores where the layer has per-row scales and x is bf16
(`triton_ops/fp8_mma.py`), else 1-8 rows on the FMA GEMV; more rows quantize
the activations to FP8 (per token, per group of bk for block weights, or the
static scale) and run our W8A8 GEMM on the FP8 tensor cores
(`triton_ops/fp8.py`). Elsewhere (the CPU, fp32) the weight is dequantized at
matmul time and multiplied in the activations' dtype: no copy is kept, the
memory stays one byte per weight.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixlm.layers.fp8_rows import Fp8Rows, quantize_rows_torch
from radixlm.layers.norm_fold import FoldedNorm, NormTarget
from radixlm.layers.quantization.base import FusedMoEMethod, LinearMethod, QuantizationConfig
from radixlm.layers.quantization.selection import LayerFilter, refuse_unknown
from radixlm.layers.quantization.specs import BlockScaleSpec, PartScalarSpec, cdiv
from radixlm.layers.quantization.unquantized import UnquantizedConfig, plain_linear
from radixlm.layers.sharding import (
    FLOAT_DTYPES,
    AxisSpec,
    ShardId,
    WeightSpec,
    copy_checked,
    gather_pieces,
    layer_shards,
)
from radixlm.layers.split_sums import SplitSums
from radixlm.utils import lazy_import, triton_installed

if TYPE_CHECKING:
    from radixlm.layers.linear import LinearBase
    from radixlm.layers.moe.fused_moe import FusedMoE

FP8 = torch.float8_e4m3fn
F32 = torch.float32
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_ops = lazy_import("radixlm.layers.quantization.triton_ops.fp8")  # Triton: CUDA only
_mma = lazy_import("radixlm.layers.quantization.triton_ops.fp8_mma")
_mma_gemv = lazy_import("radixlm.layers.quantization.triton_ops.mma_gemv")
_w8a8 = lazy_import("radixlm.layers.quantization.triton_ops.fp8_w8a8_gemv")
# The GEMV of few rows: on the tensor cores "mma-plain" (the default) reading the
# weight where it lies, "mma" from a second copy in MMA fragment order (on an H100
# faster at gate/up, slower at qkv: `fp8_mma.py`), "fma" on the CUDA cores, all
# with x in bf16; "w8a8" with x quantized per token and group of 128 on the FP8
# tensor cores (`fp8_w8a8_gemv.py`) at every row count, where the two "mma" modes
# take it from `fp8_w8a8_gemv.MIN_ROWS` rows (faster there on an H100).
MMA_ENV = "RADIXLM_FP8_GEMV"
MMA_MODES = ("mma-plain", "mma", "fma", "w8a8")


def mma_mode() -> str:
    """$RADIXLM_FP8_GEMV: "mma-plain" (also when unset: single stream 1.46x bf16 on an
    H100 against the FMA GEMV's 1.32x, BENCHMARKS.md 2026-12-05), "mma", "w8a8", or
    "" for "fma" (the FMA GEMV); any other value is refused."""
    mode = os.environ.get(MMA_ENV) or "mma-plain"
    if mode not in MMA_MODES:
        raise ValueError(f"${MMA_ENV}={mode!r}: expected one of {', '.join(MMA_MODES)} "
                         "(or unset)")
    return "" if mode == "fma" else mode


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes, fp32 scale per row) of a float matrix: scale = max |row| / 448,
    the codes those our activation kernels make (`fp8_rows.quantize_rows_torch`)."""
    codes, scales = quantize_rows_torch(w)
    return codes, scales[:, 0]


@functools.cache
def _triton() -> bool:
    return triton_installed()


def kernels_run(x: torch.Tensor) -> bool:
    """Whether products on `x` go through our Triton kernels: CUDA (or the Triton
    interpreter, for tests) in bf16/fp16. Float32 activations dequantize instead
    (the tensor cores would round them to tf32)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not _triton():
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Fp8Weight:
    """What the products read, derived after loading (views of the parameters
    and small scale tables; never a copy of the weight, but for a tied LM
    head's codes: `fp8_head.py`).

    `weight` [N, K] FP8 (rows may be strided). `scales`: with `block_k` 0 one
    fp32 per row [N]; else [N / scale_rows, cdiv(K, block_k)], row i the
    scales of weight rows [i * scale_rows, (i + 1) * scale_rows), column j
    those of features [j * block_k, (j + 1) * block_k). `input_scale`: the
    static activation scale [1], or None (dynamic)."""

    weight: torch.Tensor
    scales: torch.Tensor
    block_k: int = 0
    scale_rows: int = 1
    input_scale: torch.Tensor | None = None
    weight_only: bool = False  # activations stay in their dtype at every batch size
    # For the tensor-core GEMV (MMA_ENV): the weight again in MMA fragment order, or
    # `weight` itself ("mma-plain": read where it lies).
    mma: torch.Tensor | None = None
    # Rows from which products go through `fp8_w8a8_gemv` (to its ROUTE_MAX_ROWS;
    # see MMA_ENV); 0: never.
    w8a8_from: int = 0

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [N, K]."""
        n, k = self.weight.shape
        w = self.weight.float()
        if not self.block_k:
            return w.mul_(self.scales[:, None])
        s = self.scales.repeat_interleave(self.scale_rows, 0)[:n]
        return w.mul_(s.repeat_interleave(self.block_k, 1)[:, :k])


def with_tensor_cores(w: Fp8Weight) -> Fp8Weight:
    """`w` set up for the tensor-core GEMVs unless $RADIXLM_FP8_GEMV=fma: marked
    for `fp8_w8a8_gemv` where activations are dynamic and the scales fit
    (`fp8_w8a8_gemv.takes`), and, but under "w8a8", given the operand of the
    GEMV with x in bf16 where the layer fits that one (`fp8_mma.takes`: per-row
    or 128-feature block scales, whole tiles; "mma-plain" also rows 16-byte
    aligned): its weight a second time in MMA fragment order ("mma"), or the
    weight itself ("mma-plain")."""
    n, k = w.weight.shape
    mode = mma_mode()
    if not (mode and w.weight.is_cuda):
        return w
    dynamic = w.input_scale is None and not w.weight_only
    if dynamic and _w8a8.takes(k, w.block_k, 1):
        w = dataclasses.replace(w, w8a8_from=1 if mode == "w8a8" else _w8a8.MIN_ROWS)
    if mode == "w8a8" or not _mma.takes(n, k, w.block_k, torch.bfloat16, w.scale_rows):
        return w
    if mode == "mma-plain":
        return dataclasses.replace(w, mma=w.weight) if _mma.plain_fits(w.weight) else w
    return dataclasses.replace(w, mma=_mma.mma_layout(w.weight))


def fp8_product(layer: LinearBase, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None,
                out: torch.Tensor | None, silu_mul: bool = False) -> torch.Tensor | None:
    w: Fp8Weight | None = getattr(layer, "fp8", None)
    assert w is not None, "process_weights_after_loading has not run on this layer"
    if isinstance(x, Fp8Rows) and not kernels_run(x):
        x = x.dequantize()
    if kernels_run(x):
        return _ops.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, w.input_scale,
                               bias, out=out, silu_mul=silu_mul, weight_only=w.weight_only,
                               mma=w.mma, w8a8_from=w.w8a8_from)
    if silu_mul:
        return None
    return plain_linear(x, w.dequantize().to(x.dtype), bias, out)


class Fp8ProductMethod(LinearMethod):
    """Products on the layer's derived `fp8` (an `Fp8Weight`), which each method's
    `process_weights_after_loading` sets from the freshly loaded parameters."""

    def takes_fp8_rows(self, layer: LinearBase, rows: int) -> bool:
        w: Fp8Weight | None = getattr(layer, "fp8", None)
        return (w is not None and w.weight.is_cuda and _triton()
                and layer.params_dtype in (torch.bfloat16, torch.float16)
                and _ops.takes_fp8_rows(rows, w.block_k, w.scale_rows, w.input_scale,
                                        w.weight_only, w.mma, w.w8a8_from))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_product(layer, x, bias, out)

    def apply_silu_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        if layer.bias is not None:
            return None
        return fp8_product(layer, x, None, None, silu_mul=True)

    def drop_derived(self, layer: LinearBase) -> None:
        layer.fp8 = None

    # A folded norm (`layers/norm_fold.py`) in the tensor-core GEMV's epilogues, at
    # the rows that GEMV takes (below the W8A8 GEMV's).
    def norm_fold_rows(self, layer: LinearBase, output: bool) -> int:
        w: Fp8Weight | None = getattr(layer, "fp8", None)
        if w is None or w.mma is None or not w.weight.is_cuda:
            return 0
        if output and not _mma.folds_out(*w.weight.shape):
            return 0
        return min(_mma.GEMV_ROWS, w.w8a8_from - 1) if w.w8a8_from else _mma.GEMV_ROWS

    def _mma_gemv(self, layer: LinearBase, x: torch.Tensor) -> Any:
        """The tensor-core GEMV of x's rows, which can fold a norm or leave its
        split-K sum, or None (not this layer, not these rows: the defaults then)."""
        w: Fp8Weight | None = getattr(layer, "fp8", None)
        if (w is None or w.mma is None or not (x.is_cuda and x.dtype == torch.bfloat16)
                or not 1 <= x.shape[0] <= self.norm_fold_rows(layer, False)
                or not _mma_gemv.rows_fit(x, _mma.GEMV_ROWS)):
            return None
        gemv = _mma.fp8_gemv_mma_plain if w.mma is w.weight else _mma.fp8_gemv_mma
        return functools.partial(gemv, x, w.mma, w.scales,
                                 scale_rows=w.scale_rows if w.block_k else 0)

    def apply_normed(self, layer: LinearBase, x: FoldedNorm, silu_mul: bool = False
                     ) -> torch.Tensor:
        gemv = self._mma_gemv(layer, x.x)
        if gemv is None:
            return super().apply_normed(layer, x, silu_mul)
        return gemv(layer.bias, silu_mul=silu_mul, norm_in=x)

    def apply_unsummed(self, layer: LinearBase, x: torch.Tensor | Fp8Rows
                       ) -> torch.Tensor | SplitSums:
        gemv = self._mma_gemv(layer, x) if isinstance(x, torch.Tensor) else None
        if gemv is None:
            return super().apply_unsummed(layer, x)
        return gemv(layer.bias, defer_sum=True)

    def apply_into_norm(self, layer: LinearBase, x: torch.Tensor,
                        target: NormTarget) -> FoldedNorm:
        gemv = self._mma_gemv(layer, x)
        if gemv is None or not self.norm_fold_rows(layer, True):
            return super().apply_into_norm(layer, x, target)
        return gemv(layer.bias, norm_out=target)


# ---- a float checkpoint quantized at load ------------------------------------------------
def row_stride(features: int) -> int:
    """Bytes per row of an online-quantized weight: the codes, then the row's fp32
    scale in the last 4 bytes, padded to 16 so rows stay aligned for wide loads."""
    return cdiv(features + 4, 16) * 16


class Fp8OnlineSpec(WeightSpec):
    """A float checkpoint tensor held as FP8 codes with one scale per output row,
    both in the one parameter [rows, row_stride(features)] (codes, then the
    scale's 4 bytes), so that a weight update and its rollback, which save
    and restore parameters, move them together. Read back as floats (the
    codes times their scales), not the floats that were loaded."""

    checkpoint_dtypes = FLOAT_DTYPES
    gather_dtype = F32  # what `gather` returns (not the parameter's dtype)

    def hf_shape(self, layer: Any, param: torch.nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        rows = sum(layer.output_piece(s).total for s in layer_shards(layer, shard_id))
        return (rows, layer.input_piece().total)

    def required_shards(self, layer: Any, param: torch.nn.Parameter) -> set[ShardId]:
        return set(layer.shard_ids)

    def load(self, layer: Any, param: torch.nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        shards = layer_shards(layer, shard_id)
        if len(shards) > 1:  # the fused tensor whole
            totals = [layer.output_piece(s).total for s in shards]
            if loaded.dim() != 2 or loaded.shape[0] != sum(totals):
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}: expected "
                                 f"{sum(totals)} rows")
            for s, part in zip(shards, loaded.split(totals), strict=True):
                self.load(layer, param, part, s)
            return
        rows, features = layer.output_piece(shards[0]), layer.input_piece()
        if tuple(loaded.shape) != (rows.total, features.total):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"[{rows.total}, {features.total}]")
        mine = loaded.narrow(0, rows.start, rows.size).to(param.device)
        codes, scales = quantize_rows(mine)  # whole rows: every rank's scales agree
        dst = param.data.narrow(0, rows.offset, rows.size)
        copy_checked(dst[:, :features.size], codes.narrow(1, features.start, features.size))
        dst.view(torch.uint8)[:, -4:].copy_(scales.view(torch.uint8).view(-1, 4))

    def gather(self, layer: Any, param: torch.nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        shards = layer_shards(layer, shard_id)
        if len(shards) > 1:
            return torch.cat([self.gather(layer, param, s) for s in shards])
        rows, features = layer.output_piece(shards[0]), layer.input_piece()
        local = param.data.narrow(0, rows.offset, rows.size)
        values = local[:, :features.size].float() * online_scales(local)[:, None]
        group = getattr(layer, "group", None)  # an expert group's ranks, under ep
        if not rows.whole:
            values = gather_pieces(values, rows.start, 0, rows.total, group)
        if not features.whole:
            values = gather_pieces(values, features.start, 1, features.total, group)
        return values



def online_scales(rows: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of each row of an online-quantized weight (a copy, [rows])."""
    return rows.view(torch.uint8)[:, -4:].contiguous().view(torch.float32).view(-1)


class Fp8OnlineLinearMethod(Fp8ProductMethod):
    """A float checkpoint's weight quantized to FP8 per output row at load."""

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype) -> None:
        weight = torch.zeros(sum(output_partition_sizes), row_stride(input_size_per_partition),
                             dtype=FP8)
        layer.add_weight("weight", weight, Fp8OnlineSpec())

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        k = layer.input_piece().size
        layer.fp8 = with_tensor_cores(Fp8Weight(layer.weight.data[:, :k],
                                                online_scales(layer.weight.data)))


# ---- FP8 checkpoints -------------------------------------------------------------------
@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 checkpoint stores a layer: `strategy` tensor (one scale per
    tensor), channel (one per output row, [out, 1]) or block ([bn, bk]
    blocks); the scale tensors' names; whether activations have a static
    scale, or stay unquantized (`weight_only`, W8A16); and the checkpoint
    shape of one per-tensor number (() or (1,))."""

    strategy: str
    weight_scale: str = "weight_scale"
    block: tuple[int, int] | None = None
    static_input: bool = False
    input_scale: str = "input_scale"
    scalar_ndim: int = 0
    weight_only: bool = False

    def describe(self) -> str:
        kind = (f"{self.block[0]}x{self.block[1]} block" if self.block
                else f"per-{self.strategy}")
        if self.weight_only:
            return f"{kind} weight scales, activations unquantized (W8A16)"
        acts = "static" if self.static_input else (
            f"dynamic per-token-group-{self.block[1]}" if self.block else "dynamic per-token")
        return f"{kind} weight scales, {acts} activation scales"


class Fp8LinearMethod(Fp8ProductMethod):
    """An FP8 checkpoint's weight [out, in], its scales as `scheme` says."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype) -> None:
        s = self.scheme
        n, k, parts = sum(output_partition_sizes), input_size_per_partition, len(layer.shard_ids)
        layer.add_weight("weight", torch.zeros(n, k, dtype=FP8),
                         AxisSpec(output_dim=0, input_dim=1, checkpoint_dtypes=frozenset({FP8})))
        if s.strategy == "block":
            bn, bk = s.block
            spec = BlockScaleSpec(bn, bk)
            try:
                spec.check_cuts(layer)
            except ValueError as e:
                raise ValueError(f"{layer.prefix}: tensor-parallel size {layer.tp_size} cuts "
                                 f"a weight_block_size [{bn}, {bk}] FP8 weight inside a block "
                                 f"({e}); use a tensor-parallel size whose pieces are whole "
                                 "blocks") from None
            rows = sum(spec.part_rows(layer))
            layer.add_weight(s.weight_scale, torch.ones(rows, cdiv(k, bk), dtype=F32), spec)
        elif s.strategy == "channel":
            layer.add_weight(s.weight_scale, torch.ones(n, 1, dtype=F32),
                             AxisSpec(output_dim=0, input_dim=None))
        else:
            layer.add_weight(s.weight_scale, torch.ones(parts, dtype=F32),
                             PartScalarSpec(s.scalar_ndim))
        if s.static_input:
            layer.add_weight(s.input_scale, torch.ones(parts, dtype=F32),
                             PartScalarSpec(s.scalar_ndim))

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        s = self.scheme
        weight, scale = layer.weight.data, getattr(layer, s.weight_scale).data.float()
        rows = [layer.output_piece(p).size for p in layer.shard_ids]
        # The fused parts read the same input: the largest part's scale clips none.
        static = getattr(layer, s.input_scale).data.float().amax().reshape(1) \
            if s.static_input else None
        if s.strategy == "block":
            table, scale_rows = block_table(scale, rows, s.block[0])
            layer.fp8 = with_tensor_cores(Fp8Weight(weight, table, s.block[1], scale_rows,
                                                    static, s.weight_only))
            return
        if s.strategy == "channel":
            per_row = scale.reshape(-1).contiguous()
        else:
            per_row = scale.repeat_interleave(torch.tensor(rows, device=scale.device))
        layer.fp8 = with_tensor_cores(Fp8Weight(weight, per_row, input_scale=static,
                                                weight_only=s.weight_only))


def block_table(grid: torch.Tensor, part_rows: list[int], block_n: int,
                scale_rows: int | None = None) -> tuple[torch.Tensor, int]:
    """The stacked block-scale grids of a fused layer's parts (`BlockScaleSpec`) as
    one table with a row per `scale_rows` weight rows, and that count: by
    default the largest that divides `block_n` and every part, so that a part
    whose rows are not whole blocks (a ragged last block, or a k_proj of 192
    rows) keeps its own scales; a smaller common divisor when given (stacks
    that must share one). Equal to the grid when every part is whole blocks.
    The grid's rows are its dim -2 (a leading expert dim is kept)."""
    g = math.gcd(block_n, *part_rows) if scale_rows is None else scale_rows
    if block_n % g or any(rows % g for rows in part_rows):
        raise ValueError(f"{g} scale rows do not divide the block of {block_n} rows and the "
                         f"parts of {part_rows} rows")
    if g == block_n:
        return grid.contiguous(), g
    index, grid_row = [], 0
    for rows in part_rows:
        index.append(grid_row + torch.arange(rows // g) * g // block_n)
        grid_row += cdiv(rows, block_n)
    return grid.index_select(-2, torch.cat(index).to(grid.device)).contiguous(), g


# ---- the config -------------------------------------------------------------------------
HF_FP8_FIELDS = ("quant_method", "fmt", "activation_scheme", "weight_block_size",
                 "modules_to_not_convert", "ignored_layers", "modules_to_convert", "dequantize",
                 "scale_fmt", "expert_dtype")


class Fp8Config(QuantizationConfig):
    """Every linear layer but the LM head (and those the checkpoint names as not
    converted) in FP8: quantized at load (`scheme` None) or as the checkpoint
    stores it."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme | None = None, skip: LayerFilter | None = None,
                 fallback: QuantizationConfig | None = None, source: str = "") -> None:
        self.scheme = scheme
        self.skip = skip or LayerFilter()
        self.fallback = fallback or UnquantizedConfig()
        self.source = source or ("a float checkpoint quantized at load" if scheme is None
                                 else "an FP8 checkpoint")
        self.counts: Counter[str] = Counter()

    @classmethod
    def from_hf_config(cls, hf_quant_config: dict[str, Any], **options: Any) -> Fp8Config:
        c = hf_quant_config
        refuse_unknown(c, HF_FP8_FIELDS, "an FP8 checkpoint's")
        if str(c.get("fmt", "e4m3")).lower() not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"FP8 quantization_config fmt={c['fmt']!r}: radixlm reads e4m3 "
                             "weights only")
        scheme = str(c.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"FP8 quantization_config activation_scheme={scheme!r}: expected "
                             "dynamic or static")
        if c.get("scale_fmt", "float") != "float":
            raise ValueError(f"FP8 quantization_config scale_fmt={c['scale_fmt']!r}: radixlm "
                             "reads float32 block scales only (not ue8m0)")
        for field, default in (("dequantize", False), ("modules_to_convert", None)):
            if c.get(field) not in (default, [], False, None):
                raise ValueError(f"FP8 quantization_config {field}={c[field]!r} is not "
                                 "supported")
        block = c.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or any(int(b) <= 0 for b in block):
                raise ValueError(f"FP8 quantization_config weight_block_size={block!r}: "
                                 "expected two positive integers")
            bk = int(block[1])
            if bk < 16 or bk & (bk - 1):
                raise ValueError(f"FP8 quantization_config weight_block_size={block!r}: the "
                                 "block's input size must be a power of two >= 16")
            plan = Fp8Scheme("block", "weight_scale_inv", (int(block[0]), bk),
                             scheme == "static", "activation_scale")
        else:
            plan = Fp8Scheme("tensor", "weight_scale", None, scheme == "static", "input_scale")
        skip = LayerFilter(c.get("modules_to_not_convert") or c.get("ignored_layers") or (),
                           options.get("fused"))
        return cls(plan, skip, options.get("fallback"), source="an FP8 checkpoint")

    def get_linear_method(self, layer: Any, prefix: str) -> LinearMethod:
        if prefix == "lm_head" or self.skip.skipped(prefix, layer.shard_ids):
            self.counts["float"] += 1
            return self.fallback.get_linear_method(layer, prefix)
        self.counts["fp8"] += 1
        if self.scheme is None:
            return Fp8OnlineLinearMethod()
        return Fp8LinearMethod(self.scheme)

    def get_moe_method(self, layer: FusedMoE, prefix: str) -> FusedMoEMethod:
        """FP8 experts (`fp8_moe.py`) in this config's scheme; floats where the
        checkpoint leaves the experts unconverted."""
        if self.skip.skipped(prefix):
            self.counts["float experts"] += 1
            return self.fallback.get_moe_method(layer, prefix)
        from radixlm.layers.quantization.fp8_moe import Fp8FusedMoEMethod

        self.counts["fp8 experts"] += 1
        return Fp8FusedMoEMethod(self.scheme, getattr(self.fallback, "moe_backend", "auto"))

    def describe(self) -> str:
        how = ("per-channel weight scales, dynamic per-token activation scales"
               if self.scheme is None else self.scheme.describe())
        rows = (_w8a8.MIN_ROWS, _w8a8.ROUTE_MAX_ROWS) if _triton() else None
        w8a8 = (f"; {rows[0]}-{rows[1]} rows instead with FP8 activations per token and "
                "group of 128 where activations are dynamic") if rows else ""
        gemv = {"mma": " (1-32 rows on the tensor cores, $RADIXLM_FP8_GEMV=mma: a second copy "
                       f"of the per-row-scaled weights in MMA fragment order; else 1-8{w8a8})",
                "mma-plain": " (1-32 rows on the tensor cores, reading the per-row-scaled "
                             f"weights where they lie; else 1-8{w8a8})",
                "w8a8": f" (from one row{f' to {rows[1]}' if rows else ''} with FP8 "
                        f"activations per token and group of 128 on the FP8 tensor cores, "
                        f"${MMA_ENV}=w8a8, where activations are dynamic)",
                "": f" (1-8 rows on the CUDA cores, ${MMA_ENV}=fma)"}[mma_mode()]
        experts = ""
        if self.counts["fp8 experts"] or self.counts["float experts"]:
            experts = (f"; {self.counts['fp8 experts']} MoE layers' experts in FP8 "
                       f"(weight-only products), {self.counts['float experts']} in floats")
        return (f"quantization fp8 ({self.source}): {self.counts['fp8']} linear layers in FP8 "
                f"e4m3 ({how}), {self.counts['float']} in floats (the LM head, layers the "
                f"checkpoint leaves unquantized){experts}; "
                f"CUDA: our FP8 GEMV at few rows{gemv}, W8A8 GEMM above; the CPU dequantizes "
                "at matmul time")
