"""int4 weight-only checkpoints: AWQ (`--quantization awq`) and GPTQ (`gptq`).

What the tools write, per linear layer with K input and N output features
and groups of G input features (every tensor int32 unless said):
- AutoAWQ (GEMM version): `qweight` [K, N / 8], 8 output features per int32
  in AWQ's interleaved order (nibble i, at bit 4 i, holds feature
  8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]); `qzeros` [K / G, N / 8], the same
  order; `scales` fp16 [K / G, N]. w = (q - z) * s.
- AutoGPTQ / GPTQModel: `qweight` [K / 8, N], 8 input features per int32 in
  order (nibble i: feature 8 r + i); `qzeros` [K / G, N / 8] in order, holding
  z - 1 in the v1 format (`checkpoint_format` gptq, the default) and z in
  v2 (gptq_v2); `scales` fp16 [K / G, N]; `g_idx` [K], the group of each
  input feature (i // G, or any order with `desc_act`: act-order).

How we hold them, one layout for both so one pair of kernels reads them
(`triton_ops/int4.py`): `qweight` [K / 8, N] as GPTQ packs it (an AWQ
checkpoint's is repacked at load, `AwqQweightSpec`), `qzeros` unpacked to
uint8 [K / G, N] true zero points, `scales` and `g_idx` as they come. Each
spec converts back on read-back, so `get_weights_by_name` gives the
checkpoint's tensors. With act-order the scales and zeros are not cut by
tensor parallelism (a rank's features may belong to any group): every rank
holds them whole and looks groups up through its piece of `g_idx`.

Products: on CUDA in bf16/fp16 our Triton kernels. A layer built on CUDA that
the tensor-core kernels take (no act-order, whole tiles of 16 output features,
group 64 or 128) holds `qweight` in their MMA fragment order (`FragmentSpec`:
int32 [N / 16, K / 64, 32, 4], the same bytes), and every product reads that:
1-128 rows the tensor-core GEMV (`triton_ops/int4_mma.py`, a launch per 64
rows, fused with the MLP's silu(gate) * up on a merged gate/up layer), above
that the weight dequantized whole and a cuBLAS GEMM. Loads and read-backs
convert through the GPTQ form, so updates and `get_weights_by_name` see the
checkpoint's tensors. Other layers, and every layer under
$RADIXLM_INT4_GEMV=fma, keep the GPTQ form: one row a CUDA-core GEMV in fp32
registers (fused SiLU too), up to 128 rows a GEMM on the tensor cores with the
scale folded out of the weights, above that the weight dequantized whole.
Elsewhere the weight is dequantized at matmul time (fp32 [N, K] for the one
product, then freed: the memory stays half a byte per weight).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixlm.layers.norm_fold import FoldedNorm, NormTarget
from radixlm.layers.quantization.base import LinearMethod, QuantizationConfig
from radixlm.layers.quantization.fp8 import kernels_run
from radixlm.layers.quantization.selection import LayerFilter
from radixlm.layers.quantization.specs import PartVectorSpec
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
from radixlm.utils import lazy_import

if TYPE_CHECKING:
    from radixlm.layers.linear import LinearBase

_ops = lazy_import("radixlm.layers.quantization.triton_ops.int4")  # Triton: CUDA only
_mma = lazy_import("radixlm.layers.quantization.triton_ops.int4_mma")
# "fma": the CUDA-core GEMV and the GPTQ form on CUDA; unset or "mma": fragment order
MMA_ENV = "RADIXLM_INT4_GEMV"
INT32 = frozenset({torch.int32})
# The output feature (within its 8) that AWQ packs into nibble i.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = tuple(range(0, 32, 4))


def mma_requested() -> bool:
    """Whether CUDA layers take the tensor-core kernels: unset or "mma" (the default,
    faster on an H100 at one row and offline: BENCHMARKS.md 2026-12-05), "fma" opts
    out; any other value of $RADIXLM_INT4_GEMV is refused."""
    mode = os.environ.get(MMA_ENV, "")
    if mode not in ("", "mma", "fma"):
        raise ValueError(f"${MMA_ENV}={mode!r}: expected 'mma' or 'fma' (or unset)")
    return mode != "fma"


# ---- packing (torch, any device) ---------------------------------------------------------
def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32, wrapping the top bit into the sign."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C / 8] words of 8 nibbles along the columns -> [R, C] int32 in column
    order (`order`: the column of each nibble within its 8, AWQ_ORDER for AWQ)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    vals = (packed.to(torch.int32)[..., None] >> shifts) & 0xF  # [R, C / 8, nibble]
    if order is not None:
        vals = vals[..., [order.index(j) for j in range(8)]]
    return vals.reshape(*packed.shape[:-1], -1)


def pack_cols(vals: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `unpack_cols`: [R, C] values in 0..15 -> [R, C / 8] int32."""
    v = vals.to(torch.int64).reshape(*vals.shape[:-1], -1, 8)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=vals.device)
    return _to_int32((v << shifts).sum(-1))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R / 8, C] words of 8 nibbles along the rows -> [R, C] int32."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    vals = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF
    return vals.reshape(-1, packed.shape[1])


def pack_rows(vals: torch.Tensor) -> torch.Tensor:
    """[R, C] values in 0..15 -> [R / 8, C] int32 (GPTQ's qweight)."""
    v = vals.to(torch.int64).reshape(-1, 8, vals.shape[1])
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=vals.device)
    return _to_int32((v << shifts[None, :, None]).sum(1))


def quantize_int4(w: torch.Tensor, group: int, sym: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of a float [N, K] weight in groups of `group` input
    features: (q [K, N], zero points [K / G, N], fp16 scales [K / G, N]) with
    w ~ (q - z) * s. Asymmetric as AutoAWQ (min / max over the group), or
    symmetric as GPTQ's `sym` (z = 8, s = 2 max |w| / 15). No activation-aware
    scaling or error feedback: dummy weights and baselines, not a quantizer."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    if sym:
        scales = (2 * wg.abs().amax(-1) / 15).clamp(min=1e-5).half().float()
        zeros = torch.full_like(scales, 8.0)
    else:
        hi, lo = wg.amax(-1), wg.amin(-1)
        scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
        zeros = (-torch.round(lo / scales)).clamp(0, 15)
    q = (torch.round(wg / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    return (q.reshape(n, k).T.to(torch.int32).contiguous(),
            zeros.T.to(torch.int32).contiguous(), scales.T.half().contiguous())


def awq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """`quantize_int4` of `w` as AutoAWQ's GEMM tensors (qweight, qzeros, scales)."""
    q, z, s = quantize_int4(w, group)
    return {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(z, AWQ_ORDER), "scales": s}


def gptq_tensors(w: torch.Tensor, group: int, sym: bool = True,
                 v1: bool = True) -> dict[str, torch.Tensor]:
    """`quantize_int4` of `w` as GPTQ's tensors (desc_act False); `v1`: zeros
    stored minus one, as AutoGPTQ writes them (a zero point of 0 becomes 1)."""
    q, z, s = quantize_int4(w, group, sym)
    if v1:
        z = z.clamp(min=1) - 1
    k = w.shape[1]
    return {"qweight": pack_rows(q), "qzeros": pack_cols(z), "scales": s,
            "g_idx": (torch.arange(k, device=w.device) // group).to(torch.int32)}


def dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               groups: torch.Tensor) -> torch.Tensor:
    """Our layout (qweight [K / 8, N], zeros uint8 [Gr, N], scales [Gr, N]; `groups`
    [K] the row of each input feature) -> the fp32 weight [N, K]."""
    q = unpack_rows(qweight).float()
    return ((q - zeros[groups].float()) * scales[groups].float()).T


# ---- specs: the checkpoint's tensors, held in our layout --------------------------------
@dataclass(frozen=True)
class _ConvertedSpec(AxisSpec):
    """An AxisSpec that describes the checkpoint tensor (its dims and packing,
    hence its shape and tensor-parallel cuts) while the parameter holds a
    converted local piece, output features along dim 1 in both (input features,
    when cut, along dim 0)."""

    def to_ours(self, piece: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to_checkpoint(self, ours: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load(self, layer: Any, param: torch.nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        shards = self._shards(layer, shard_id)
        if len(shards) > 1:  # the fused tensor whole
            totals = [self._output_piece(layer, s).total for s in shards]
            _check_dim(loaded, 1, sum(totals))
            for s, part in zip(shards, loaded.split(totals, 1), strict=True):
                self.load(layer, param, part, s)
            return
        out = self._output_piece(layer, shards[0])
        _check_dim(loaded, 1, out.total)
        src = loaded.narrow(1, out.start, out.size)
        if self.input_dim is None:
            _check_dim(loaded, 0, param.shape[0])
        else:
            features = self._input_piece(layer)
            _check_dim(loaded, 0, features.total)
            src = src.narrow(0, features.start, features.size)
        rows = layer.output_piece(shards[0])
        dst = param.data.narrow(1, rows.offset, rows.size)
        copy_checked(dst, self.to_ours(src.to(param.device)).to(param.dtype))

    def gather(self, layer: Any, param: torch.nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        parts = []
        for s in self._shards(layer, shard_id):
            rows, out = layer.output_piece(s), self._output_piece(layer, s)
            local = self.to_checkpoint(param.data.narrow(1, rows.offset, rows.size))
            if self.input_dim is not None:
                features = self._input_piece(layer)
                if not features.whole:
                    local = gather_pieces(local, features.start, 0, features.total)
            if not out.whole:
                local = gather_pieces(local, out.start, 1, out.total)
            parts.append(local)
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _check_dim(t: torch.Tensor, dim: int, expected: int) -> None:
    if t.dim() != 2 or t.shape[dim] != expected:
        raise ValueError(f"checkpoint tensor of shape {tuple(t.shape)}: expected {expected} "
                         f"entries along dim {dim}")


@dataclass(frozen=True)
class AwqQweightSpec(_ConvertedSpec):
    """AWQ's qweight [K, N / 8] (interleaved) held as GPTQ's [K / 8, N]."""

    output_dim: int | None = 1
    input_dim: int | None = 0
    output_packing: tuple[int, int] | None = (8, 1)
    checkpoint_dtypes: frozenset[torch.dtype] = INT32

    def to_ours(self, piece: torch.Tensor) -> torch.Tensor:
        return pack_rows(unpack_cols(piece, AWQ_ORDER))

    def to_checkpoint(self, ours: torch.Tensor) -> torch.Tensor:
        return pack_cols(unpack_rows(ours), AWQ_ORDER)


@dataclass(frozen=True)
class ZerosSpec(_ConvertedSpec):
    """qzeros [groups, N / 8] (AWQ's order or in order; stored minus `offset`)
    held as uint8 zero points [groups, N]. `input_dim` None: every rank holds
    every group (act-order)."""

    output_dim: int | None = 1
    input_dim: int | None = 0
    input_packing: tuple[int, int] | None = None
    output_packing: tuple[int, int] | None = (8, 1)
    checkpoint_dtypes: frozenset[torch.dtype] = INT32
    order: tuple[int, ...] | None = None
    offset: int = 0

    def to_ours(self, piece: torch.Tensor) -> torch.Tensor:
        return unpack_cols(piece, self.order) + self.offset

    def to_checkpoint(self, ours: torch.Tensor) -> torch.Tensor:
        return pack_cols((ours.to(torch.int32) - self.offset) & 0xF, self.order)


@dataclass(frozen=True)
class FragmentSpec(WeightSpec):
    """qweight held as the tensor-core kernels read it: int32 [N / 16, K / 64, 32, 4]
    in MMA fragment order (`int4_mma.mma_layout`), while `inner`, the spec of the
    GPTQ-form parameter [K / 8, N] (AWQ's repacking or GPTQ's axes), describes the
    checkpoint tensor: its shape, dtypes and tensor-parallel cuts. A load goes
    through a GPTQ-form stand-in of the layer on the parameter's device and
    converts the fused parts it wrote; a read-back converts the whole parameter
    back; so one copy of the weights stays resident. Every fused part must be
    whole tiles of 16 output features (`fragment_order`)."""

    inner: AxisSpec = dataclasses.field(default_factory=AxisSpec)
    checkpoint_dtypes: frozenset[torch.dtype] = INT32

    @staticmethod
    def _gptq_form(param: torch.nn.Parameter, data: torch.Tensor | None = None,
                   device: torch.device | str | None = None) -> torch.nn.Parameter:
        tiles, chunks = param.shape[:2]
        if data is None:
            data = torch.empty(chunks * 8, tiles * 16, dtype=torch.int32,
                               device=device or param.device)
        return torch.nn.Parameter(data, requires_grad=False)

    def hf_shape(self, layer: Any, param: torch.nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        return self.inner.hf_shape(layer, self._gptq_form(param, device="meta"), shard_id)

    def required_shards(self, layer: Any, param: torch.nn.Parameter) -> set[ShardId]:
        return self.inner.required_shards(layer, self._gptq_form(param, device="meta"))

    def load(self, layer: Any, param: torch.nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        plain = self._gptq_form(param)
        self.inner.load(layer, plain, loaded, shard_id)
        for s in layer_shards(layer, shard_id):
            rows = layer.output_piece(s)
            for start, size in _column_blocks(rows.offset, rows.size):
                q = unpack_rows(plain.data.narrow(1, start, size))
                copy_checked(param.data.narrow(0, start // 16, size // 16), _mma.mma_layout(q))

    def gather(self, layer: Any, param: torch.nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        plain = self._gptq_form(param)
        for start, size in _column_blocks(0, plain.shape[1]):
            words = param.data.narrow(0, start // 16, size // 16)
            plain.data[:, start:start + size] = pack_rows(_mma.mma_unlayout(words))
        return self.inner.gather(layer, plain, shard_id)


def _column_blocks(offset: int, size: int, block: int = 2048) -> Iterator[tuple[int, int]]:
    """(start, size) of runs of at most `block` columns covering [offset, offset + size):
    the layout conversions widen every weight to 8 bytes or more on the way, so a
    wide layer converts a block at a time."""
    for start in range(offset, offset + size, block):
        yield start, min(block, offset + size - start)


def fragment_order(parts: list[int], k: int, group: int, desc_act: bool) -> bool:
    """Whether a layer of output `parts` (its fused parts' features on this rank) and
    k input features holds qweight in MMA fragment order (`FragmentSpec`): built on
    CUDA (the loader builds under the target device), `fragment_fits`, and
    $RADIXLM_INT4_GEMV not "fma"."""
    return (mma_requested() and torch.get_default_device().type == "cuda"
            and fragment_fits(parts, k, group, desc_act))


def fragment_fits(parts: list[int], k: int, group: int, desc_act: bool) -> bool:
    """Whether the tensor-core kernels take such a layer (`int4_mma.takes`): no
    act-order, every fused part whole tiles of 16 output features."""
    return (not desc_act and all(p % 16 == 0 for p in parts)
            and _mma.takes(sum(parts), k, group, None))


# ---- the method ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4Format:
    """One checkpoint format: `kind` awq or gptq, the group size as the config
    says (-1: the whole input), GPTQ's `desc_act` and zero `offset` (v1: 1)."""

    kind: str
    group_size: int = 128
    desc_act: bool = False
    zero_offset: int = 0

    def group(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True)
class Int4Weight:
    """What the products read (the parameters themselves, and the group of each
    of this rank's input features when the checkpoint is act-order)."""

    qweight: torch.Tensor | None  # int32 [K / 8, N]; None where `mma` holds the weights
    zeros: torch.Tensor  # uint8 [groups, N]
    scales: torch.Tensor  # fp16 [groups, N]
    group: int
    g_idx: torch.Tensor | None = None  # int32 [K], act-order only
    mma: torch.Tensor | None = None  # int32 [N / 16, K / 64, 32, 4]: `FragmentSpec`'s form

    def dequantize(self) -> torch.Tensor:
        qweight = (self.qweight if self.qweight is not None else
                   pack_rows(_mma.mma_unlayout(self.mma)))
        k = qweight.shape[0] * 8
        groups = (self.g_idx.long() if self.g_idx is not None else
                  torch.arange(k, device=qweight.device) // self.group)
        return dequantize(qweight, self.zeros, self.scales, groups)


class Int4LinearMethod(LinearMethod):
    """An AWQ or GPTQ layer: `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`)."""

    def __init__(self, fmt: Int4Format) -> None:
        self.fmt = fmt
        self.fragment = False  # qweight in MMA fragment order (`fragment_order`)

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype) -> None:
        f, k, n = self.fmt, input_size_per_partition, sum(output_partition_sizes)
        total_k = layer.input_piece().total
        g = f.group(total_k)
        if total_k % g or k % 8 or g % 16:
            raise ValueError(f"{layer.prefix}: {total_k} input features ({k} on this rank) are "
                             f"not whole groups of {g} (group_size {f.group_size}), multiples "
                             "of 16, on whole int32 words")
        act_order = f.desc_act
        groups = total_k // g if act_order else k // g
        if f.kind == "awq":
            qweight_spec = AwqQweightSpec()
            zeros = ZerosSpec(input_packing=(g, 1), order=AWQ_ORDER)
        else:
            qweight_spec = AxisSpec(output_dim=1, input_dim=0, input_packing=(8, 1),
                                    checkpoint_dtypes=INT32)
            zeros = ZerosSpec(input_dim=None if act_order else 0,
                              input_packing=None if act_order else (g, 1), offset=f.zero_offset)
        scales = AxisSpec(output_dim=1, input_dim=None if act_order else 0,
                          input_packing=None if act_order else (g, 1),
                          checkpoint_dtypes=FLOAT_DTYPES)
        qweight = torch.zeros(k // 8, n, dtype=torch.int32)
        self.fragment = fragment_order(list(output_partition_sizes), k, g, act_order)
        if self.fragment:
            qweight = torch.zeros(n // 16, k // 64, 32, 4, dtype=torch.int32)
            qweight_spec = FragmentSpec(qweight_spec)
        params = [("qweight", qweight, qweight_spec),
                  ("qzeros", torch.zeros(groups, n, dtype=torch.uint8), zeros),
                  ("scales", torch.zeros(groups, n, dtype=torch.float16), scales)]
        if f.kind == "gptq":  # one per fused part (they must agree, checked after loading)
            params.append(("g_idx", torch.zeros(len(layer.shard_ids), k, dtype=torch.int32),
                           PartVectorSpec()))
        for name, data, spec in params:
            param = layer.add_weight(name, data, spec)
            try:  # refuse a tensor-parallel cut inside a packed word or a group now
                for s in spec.required_shards(layer, param):
                    spec.hf_shape(layer, param, s)
            except ValueError as e:
                raise ValueError(f"{layer.prefix}: tensor-parallel size {layer.tp_size} cuts "
                                 f"{f.kind} tensor {name} inside a packed word or group ({e})"
                                 ) from None

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        f = self.fmt
        g = f.group(layer.input_piece().total)
        g_idx = None
        if f.kind == "gptq":
            parts = layer.g_idx.data
            if not bool((parts == parts[0]).all()):
                raise ValueError(f"{layer.prefix}: the fused parts {list(layer.shard_ids)} "
                                 "have different g_idx (act orders), which one weight cannot "
                                 "hold")
            g_idx = parts[0]
            piece = layer.input_piece()
            trivial = (torch.arange(piece.start, piece.start + piece.size,
                                    device=g_idx.device) // g).to(g_idx.dtype)
            if not f.desc_act:
                if not torch.equal(g_idx, trivial):
                    raise ValueError(f"{layer.prefix}.g_idx orders the input features (act-order) "
                                     "but the quantization_config says desc_act=false")
                g_idx = None
            elif torch.equal(g_idx, trivial):
                g_idx = None if piece.whole else g_idx
        if self.fragment:
            layer.int4 = Int4Weight(None, layer.qzeros.data, layer.scales.data, g,
                                    mma=layer.qweight.data)
            return
        layer.int4 = Int4Weight(layer.qweight.data, layer.qzeros.data, layer.scales.data, g,
                                None if g_idx is None else g_idx.to(torch.int32).contiguous())

    def drop_derived(self, layer: LinearBase) -> None:
        layer.int4 = None

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        w: Int4Weight | None = getattr(layer, "int4", None)
        assert w is not None, "process_weights_after_loading has not run on this layer"
        if kernels_run(x):
            return _ops.int4_linear(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx, bias,
                                    out=out, mma=w.mma)
        return plain_linear(x, w.dequantize().to(x.dtype), bias, out)

    def apply_silu_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        w: Int4Weight | None = getattr(layer, "int4", None)
        assert w is not None, "process_weights_after_loading has not run on this layer"
        if layer.bias is not None or not kernels_run(x):
            return None
        return _ops.int4_linear(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx,
                                silu_mul=True, mma=w.mma)

    # A folded norm (`layers/norm_fold.py`): the tensor-core GEMV scales its sums by
    # the norm's rstd, or adds the residual and prepares the next norm, in the
    # epilogue it runs anyway.
    def norm_fold_rows(self, layer: LinearBase, output: bool) -> int:
        w: Int4Weight | None = getattr(layer, "int4", None)
        if w is None or w.mma is None or not w.mma.is_cuda:
            return 0
        return _mma.norm_fold_rows(w.mma, w.group, output)

    def _mma_gemv(self, layer: LinearBase, x: torch.Tensor) -> Any:
        """The tensor-core GEMV of x's rows (`gemv(bias, **kw)`), which can fold a norm
        or leave its split-K sum, or None (not this layer, not these rows: the
        defaults then)."""
        w: Int4Weight | None = getattr(layer, "int4", None)
        if w is None or w.mma is None or not _mma.takes_rows(x, w.mma):
            return None
        return functools.partial(_mma.int4_gemv_mma, x, w.mma, w.zeros, w.scales, w.group)

    def apply_normed(self, layer: LinearBase, x: FoldedNorm, silu_mul: bool = False
                     ) -> torch.Tensor:
        gemv = self._mma_gemv(layer, x.x)
        if gemv is None:
            return super().apply_normed(layer, x, silu_mul)
        return gemv(layer.bias, silu_mul=silu_mul, norm_in=x)

    def apply_unsummed(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | SplitSums:
        gemv = self._mma_gemv(layer, x)
        if gemv is None:
            return super().apply_unsummed(layer, x)
        return gemv(layer.bias, defer_sum=True)

    def apply_into_norm(self, layer: LinearBase, x: torch.Tensor,
                        target: NormTarget) -> FoldedNorm:
        gemv = self._mma_gemv(layer, x)
        if gemv is None or not self.norm_fold_rows(layer, True):
            return super().apply_into_norm(layer, x, target)
        return gemv(layer.bias, norm_out=target)


# ---- the configs -----------------------------------------------------------------------------
class _Int4Config(QuantizationConfig):
    """Every linear layer but the LM head (and those the checkpoint names as not
    converted) in `fmt`. Built without a checkpoint's quantization_config
    (`--quantization awq` on a float config) it serves `--load-format dummy`
    only: `dummy_weights` quantizes the random floats."""

    def __init__(self, fmt: Int4Format, skip: LayerFilter | None = None,
                 fallback: QuantizationConfig | None = None, from_checkpoint: bool = True
                 ) -> None:
        self.fmt = fmt
        self.skip = skip or LayerFilter()
        self.fallback = fallback or UnquantizedConfig()
        self.from_checkpoint = from_checkpoint
        self.counts: Counter[str] = Counter()

    def get_linear_method(self, layer: Any, prefix: str) -> LinearMethod:
        if prefix == "lm_head" or self.skip.skipped(prefix, layer.shard_ids):
            self.counts["float"] += 1
            return self.fallback.get_linear_method(layer, prefix)
        self.counts["int4"] += 1
        return Int4LinearMethod(self.fmt)

    def checkpoint_weights(self, model_dir: str) -> Iterator[tuple[str, torch.Tensor]] | None:
        if not self.from_checkpoint:
            raise ValueError(f"quantization={self.name!r} reads {self.name.upper()} checkpoints "
                             "(a config.json quantization_config with quant_method "
                             f"{self.name!r}); this checkpoint is unquantized and radixlm does "
                             f"not quantize to int4 (only --load-format dummy makes random "
                             f"{self.name} weights)")
        return None

    def dummy_weights(self, weights: Iterator[tuple[str, torch.Tensor]], model: Any
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        from radixlm.models.weight_map import WeightMap

        weight_map = WeightMap(model)
        for name, tensor in weights:
            module = name.removesuffix(".weight")
            if (module == name or weight_map.resolve(name) is not None
                    or weight_map.resolve(f"{module}.qweight") is None):
                yield name, tensor
                continue
            group = self.fmt.group(tensor.shape[1])
            made = (awq_tensors(tensor, group) if self.fmt.kind == "awq" else
                    gptq_tensors(tensor, group, v1=self.fmt.zero_offset == 1))
            yield from ((f"{module}.{key}", value) for key, value in made.items())

    def describe(self) -> str:
        f = self.fmt
        order = ", act-order (g_idx)" if f.desc_act else ""
        source = "" if self.from_checkpoint else " (dummy weights: round-to-nearest int4)"
        products = ("GEMV at 1-128 rows on the tensor cores and a GEMM above, both reading the "
                    "weights held in MMA fragment order (layers those kernels do not take, "
                    "e.g. act-order: GEMV at one row, GEMM above)"
                    if mma_requested() else
                    f"GEMV at one row, GEMM above (${MMA_ENV}=fma: the GPTQ form)")
        return (f"quantization {self.name}{source}: {self.counts['int4']} linear layers in int4 "
                f"(group size {f.group_size}, zero points{order}), {self.counts['float']} in "
                "floats (the LM head, layers the checkpoint leaves unquantized); CUDA: our int4 "
                f"{products}; elsewhere the weights are dequantized at matmul time")


def _int(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def _check_bits_and_group(method: str, bits: Any, group: Any) -> int:
    if bits != 4:
        raise ValueError(f"{method} quantization_config bits={bits!r}: radixlm reads 4-bit "
                         "weights only")
    group = int(group)
    if group != -1 and (group < 16 or group % 16):
        raise ValueError(f"{method} quantization_config group_size={group}: expected -1 or a "
                         "multiple of 16 (the kernels step 16 features of a group at a time)")
    return group


class AWQConfig(_Int4Config):
    """AutoAWQ's GEMM checkpoints (zero points, any group size)."""

    name = "awq"

    @classmethod
    def from_hf_config(cls, hf_quant_config: dict[str, Any], **options: Any) -> AWQConfig:
        c = hf_quant_config
        group = _check_bits_and_group("AWQ", _int(c, "bits", "w_bit", default=4),
                                      _int(c, "group_size", "q_group_size", default=128))
        if not _int(c, "zero_point", default=True):
            raise ValueError("AWQ quantization_config zero_point=false: AutoAWQ's GEMM layout "
                             "has zero points; radixlm reads that layout only")
        version = str(_int(c, "version", "format", default="gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ quantization_config version={version!r}: radixlm reads "
                             "AutoAWQ's GEMM layout only (gemv / gemv_fast / marlin pack "
                             "differently)")
        if str(c.get("backend") or "").lower() == "llm-awq":
            raise ValueError("AWQ quantization_config backend='llm-awq': the llm-awq layout "
                             "differs from AutoAWQ's GEMM layout, which radixlm reads")
        skip = LayerFilter(c.get("modules_to_not_convert") or (), options.get("fused"))
        return cls(Int4Format("awq", group), skip, options.get("fallback"))


class GPTQConfig(_Int4Config):
    """AutoGPTQ / GPTQModel checkpoints: v1 or v2 zeros, sym or not, any group
    size, act-order (`desc_act`, through g_idx)."""

    name = "gptq"

    @classmethod
    def from_hf_config(cls, hf_quant_config: dict[str, Any], **options: Any) -> GPTQConfig:
        c = hf_quant_config
        group = _check_bits_and_group("GPTQ", c.get("bits", 4), c.get("group_size", 128))
        fmt = str(_int(c, "checkpoint_format", "format", default="gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ quantization_config checkpoint_format={fmt!r}: radixlm "
                             "reads gptq (v1) and gptq_v2 tensors")
        refused = {"is_marlin_format": bool(c.get("is_marlin_format")),
                   "lm_head": bool(c.get("lm_head")), "dynamic": bool(c.get("dynamic")),
                   "modules_in_block_to_quantize": bool(c.get("modules_in_block_to_quantize")),
                   "pack_dtype": str(c.get("pack_dtype", "int32")).removeprefix("torch.")
                   != "int32"}
        for field, bad in refused.items():
            if bad:
                raise ValueError(f"GPTQ quantization_config {field}={c[field]!r} is not "
                                 "supported (radixlm reads int32-packed layers with an "
                                 "unquantized LM head and one setting for every layer)")
        skip = LayerFilter(c.get("modules_to_not_convert") or (), options.get("fused"))
        return cls(Int4Format("gptq", group, bool(c.get("desc_act")),
                              1 if fmt == "gptq" else 0), skip, options.get("fallback"))


def default_format(name: str) -> Int4Format:
    """The format `--quantization awq|gptq` makes dummy weights in: group 128,
    AWQ's zero points, GPTQ v1 symmetric."""
    return Int4Format(name, 128, False, 1 if name == "gptq" else 0)

