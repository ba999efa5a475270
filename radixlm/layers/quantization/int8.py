"""Weight-only int8 for float checkpoints on the CPU (`--quantization int8`).

Every linear layer, the embedding and the LM head are quantized at load, per
output channel and symmetric (scale = max |row| / 127, over the whole row
even where a tensor-parallel rank holds only some of its columns), into the
tile layout of our kernels (`packed.py`); products run on them with
activations quantized to int8 per block of 32, as for GGUF. The checkpoint
stays float: a weight update passes floats and is quantized the same way,
and a read-back gives the int8 values times their scales (float32), not the
floats that were loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from radixlm.layers.cpu_ops import qgemm, qpack
from radixlm.layers.quantization.base import EmbeddingMethod, LinearMethod, QuantizationConfig
from radixlm.layers.quantization.gguf import check_cpu_kernels, rows_of
from radixlm.layers.quantization.packed import (
    PackedEmbeddingMethod,
    PackedLayout,
    PackedLinearMethod,
    PackedSpec,
    packed_bytes,
    part_views,
    why_not_packed,
)
from radixlm.layers.quantization.unquantized import UnquantizedConfig
from radixlm.layers.sharding import FLOAT_DTYPES, ShardId, copy_checked, gather_pieces


class Int8Spec(PackedSpec):
    """A packed int8 `weight` whose checkpoint tensors are floats [rows, features]."""

    checkpoint_dtypes = FLOAT_DTYPES

    def hf_shape(self, layer: Any, param: torch.nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        if shard_id is None and len(self.parts) > 1:
            rows = sum(layer.output_piece(p.shard_id).total for p in self.parts)
        else:
            rows = layer.output_piece(self._one(shard_id).shard_id).total
        return (rows, layer.input_piece().total)

    def load(self, layer: Any, param: torch.nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        if shard_id is None and len(self.parts) > 1:  # the checkpoint stores the fused tensor
            totals = [layer.output_piece(p.shard_id).total for p in self.parts]
            if loaded.dim() != 2 or loaded.shape[0] != sum(totals):
                raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}: expected "
                                 f"{sum(totals)} rows")
            for part, rows in zip(self.parts, loaded.split(totals), strict=True):
                self.load(layer, param, rows, part.shard_id)
            return
        part = self._one(shard_id)
        rows, features = layer.output_piece(part.shard_id), layer.input_piece()
        if tuple(loaded.shape) != (rows.total, features.total):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"[{rows.total}, {features.total}]")
        whole = self.whole(layer, part)
        (t0, t1), units = self._ranges(layer, part, whole)
        mine = loaded.narrow(0, rows.start, rows.size)
        codes = qpack.quantize_int8(mine)  # the scale of each whole row
        b0, b1 = units[0]
        if b1 - b0 != whole.k // whole.block:  # this rank's columns only
            codes.codes = codes.codes[:, b0 * whole.block:b1 * whole.block]
        w = qpack.pack(codes, in_features=features.size)
        src = PackedLayout("int8", w.n, w.k, w.in_features).views(packed_bytes(w))
        for dst, piece in zip(part_views(param.data, self.runs, part), src, strict=True):
            copy_checked(dst[:t1 - t0], piece)

    def gather(self, layer: Any, param: torch.nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        if shard_id is None and len(self.parts) > 1:
            return torch.cat([self.gather(layer, param, p.shard_id) for p in self.parts])
        part = self._one(shard_id)
        rows, features = layer.output_piece(part.shard_id), layer.input_piece()
        local = part.layout
        buf = torch.cat([v.reshape(-1) for v in part_views(param.data, self.runs, part)])
        values = qgemm.dequantize(local.weight(buf))[:rows.size]
        if not rows.whole:
            values = gather_pieces(values, rows.start, 0, rows.total)
        if not features.whole:
            values = gather_pieces(values, features.start, 1, features.total)
        return values


class Int8LinearMethod(PackedLinearMethod):
    """Products on per-channel int8 weights quantized at load."""

    spec_class = Int8Spec


class Int8Config(QuantizationConfig):
    """Every linear layer, the embedding and the LM head as per-channel int8,
    where this rank's piece is whole tiles (and blocks); floats elsewhere."""

    name = "int8"

    def __init__(self, fallback: QuantizationConfig | None = None) -> None:
        self.fallback = fallback or UnquantizedConfig()
        self.packed: set[str] = set()  # our modules whose weights are int8
        self.floats: dict[str, str] = {}

    def get_linear_method(self, layer: Any, prefix: str) -> LinearMethod:
        if not self._packs(layer, prefix):
            return self.fallback.get_linear_method(layer, prefix)
        return Int8LinearMethod(["int8"] * len(layer.shard_ids))

    def get_embedding_method(self, layer: Any, prefix: str) -> EmbeddingMethod:
        if not self._packs(layer, prefix):
            return self.fallback.get_embedding_method(layer, prefix)
        return PackedEmbeddingMethod(Int8LinearMethod(["int8"]))

    def _packs(self, layer: Any, prefix: str) -> bool:
        check_cpu_kernels(self.name)
        why = why_not_packed(layer, ["int8"] * len(layer.shard_ids), rows_of(layer),
                             layer.input_piece().size)
        if why:
            self.floats[prefix] = why
            return False
        self.packed.add(prefix)
        return True

    def describe(self) -> str:
        line = (f"quantization int8: {len(self.packed)} weights quantized per channel at load, "
                f"products on our {qgemm.default_isa()} kernels")
        if self.floats:
            shown = "; ".join(f"{p}: {why}" for p, why in list(self.floats.items())[:4])
            line += f"; {len(self.floats)} layer(s) hold floats ({shown})"
        return line
