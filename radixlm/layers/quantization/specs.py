"""Weight specs of quantized formats whose scales relate to the checkpoint
differently from a plain split (`layers/sharding.py` says what a spec answers).

- `PartScalarSpec`: one scale per fused part ([parts] floats), each part's
  checkpoint tensor a single number (a per-tensor weight or activation scale
  of q_proj, k_proj, v_proj: three numbers for our one qkv_proj).
- `PartVectorSpec`: one vector along the input features per fused part.
- `BlockScaleSpec`: the grid of a block-quantized weight's scales, one per
  [block_n, block_k] block of each part, ragged blocks at the edges where a
  dimension is not a multiple of the block (ceil). Each part's grid starts at
  the part's first row, so a fused parameter holds the parts' grids stacked;
  a tensor-parallel cut must fall on block boundaries.
- `OptionalScalarSpec`: a single number a checkpoint may carry or omit (an
  attention layer's k/v cache scales), 1.0 when it does not.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.layers.sharding import (
    FLOAT_DTYPES,
    Piece,
    Sharded,
    ShardId,
    WeightSpec,
    check_shard,
    copy_checked,
    gather_pieces,
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _one_number(loaded: torch.Tensor, what: str) -> torch.Tensor:
    if loaded.numel() != 1:
        raise ValueError(f"{what}: a checkpoint tensor of shape {tuple(loaded.shape)}, "
                         "expected a single number")
    return loaded.reshape(())


class PartScalarSpec(WeightSpec):
    """[len(layer.shard_ids)] scales, entry i the number of fused part i.
    `hf_ndim`: the checkpoint's shape for one number, () or (1,) (the formats
    differ; both load)."""

    checkpoint_dtypes = FLOAT_DTYPES

    def __init__(self, hf_ndim: int = 0) -> None:
        self.hf_ndim = hf_ndim

    def hf_shape(self, layer: Sharded, param: nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        self._index(layer, shard_id)
        return (1,) * self.hf_ndim

    def required_shards(self, layer: Sharded, param: nn.Parameter) -> set[ShardId]:
        return set(layer.shard_ids)

    def load(self, layer: Sharded, param: nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        value = _one_number(loaded, "a per-tensor scale")
        if shard_id is None:  # one number for the fused tensor whole: every part's
            param.data.copy_(value.expand_as(param.data))
            return
        param.data[self._index(layer, shard_id)] = value

    def gather(self, layer: Sharded, param: nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        if shard_id is None:
            if not bool((param.data == param.data[0]).all()):
                raise ValueError(f"the fused parts {list(layer.shard_ids)} hold different "
                                 "scales: read them one part at a time")
            return param.data[0].reshape((1,) * self.hf_ndim)
        return param.data[self._index(layer, shard_id)].reshape((1,) * self.hf_ndim)

    @staticmethod
    def _index(layer: Sharded, shard_id: ShardId) -> int:
        check_shard(layer, shard_id)
        return 0 if shard_id is None else layer.shard_ids.index(shard_id)


class PartVectorSpec(WeightSpec):
    """[len(layer.shard_ids), this rank's input features]: row i the vector of
    fused part i along the layer's input features (GPTQ's g_idx, which each of
    q/k/v_proj carries), cut as the input features are."""

    checkpoint_dtypes = frozenset({torch.int32, torch.int64})

    def hf_shape(self, layer: Sharded, param: nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        PartScalarSpec._index(layer, shard_id)
        return (layer.input_piece().total,)

    def required_shards(self, layer: Sharded, param: nn.Parameter) -> set[ShardId]:
        return set(layer.shard_ids)

    def load(self, layer: Sharded, param: nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        features = layer.input_piece()
        if tuple(loaded.shape) != (features.total,):
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)}: expected "
                             f"({features.total},)")
        piece = loaded.narrow(0, features.start, features.size)
        if shard_id is None:  # one vector for the fused tensor whole: every part's
            param.data.copy_(piece.expand_as(param.data))
            return
        param.data[PartScalarSpec._index(layer, shard_id)] = piece

    def gather(self, layer: Sharded, param: nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        local = param.data[PartScalarSpec._index(layer, shard_id)]
        features = layer.input_piece()
        return local if features.whole else gather_pieces(local, features.start, 0,
                                                          features.total)


class BlockScaleSpec(WeightSpec):
    """The scale grid of a weight quantized in [block_n, block_k] blocks (see
    the module docstring). The parameter is [sum over parts of
    cdiv(this rank's rows of the part, block_n), cdiv(this rank's input
    features, block_k)]."""

    checkpoint_dtypes = FLOAT_DTYPES

    def __init__(self, block_n: int, block_k: int) -> None:
        self.block_n = block_n
        self.block_k = block_k

    def part_rows(self, layer: Sharded) -> list[int]:
        """Rows of the parameter (block rows) of each part, on this rank."""
        return [cdiv(layer.output_piece(s).size, self.block_n) for s in layer.shard_ids]

    def hf_shape(self, layer: Sharded, param: nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        cols = cdiv(layer.input_piece().total, self.block_k)
        if shard_id is None and len(layer.shard_ids) > 1:
            totals = self._fused_totals(layer)
            return (cdiv(sum(totals), self.block_n), cols)
        rows = layer.output_piece(self._shard(layer, shard_id)).total
        return (cdiv(rows, self.block_n), cols)

    def required_shards(self, layer: Sharded, param: nn.Parameter) -> set[ShardId]:
        return set(layer.shard_ids)

    def load(self, layer: Sharded, param: nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        if shard_id is None and len(layer.shard_ids) > 1:
            # A fused checkpoint tensor: its grid splits into the parts' grids
            # only where each part but the last is whole blocks (checked).
            blocks = [t // self.block_n for t in self._fused_totals(layer)[:-1]]
            rest = loaded.shape[0] - sum(blocks)
            for s, part in zip(layer.shard_ids, loaded.split([*blocks, rest]), strict=True):
                self.load(layer, param, part, s)
            return
        shard_id = self._shard(layer, shard_id)
        shape = self.hf_shape(layer, param, shard_id)
        if tuple(loaded.shape) != shape:
            raise ValueError(f"block scales of shape {tuple(loaded.shape)}: expected {shape} "
                             f"for [{self.block_n}, {self.block_k}] blocks")
        (r0, r1), (c0, c1), offset = self._ranges(layer, shard_id)
        copy_checked(param.data[offset:offset + r1 - r0], loaded[r0:r1, c0:c1])

    def gather(self, layer: Sharded, param: nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        if shard_id is None and len(layer.shard_ids) > 1:
            self._fused_totals(layer)
            return torch.cat([self.gather(layer, param, s) for s in layer.shard_ids])
        shard_id = self._shard(layer, shard_id)
        (r0, r1), (c0, c1), offset = self._ranges(layer, shard_id)
        local = param.data[offset:offset + r1 - r0]
        rows_total, cols_total = self.hf_shape(layer, param, shard_id)
        if r1 - r0 != rows_total:
            local = gather_pieces(local, r0, 0, rows_total)
        if c1 - c0 != cols_total:
            local = gather_pieces(local, c0, 1, cols_total)
        return local

    def check_cuts(self, layer: Sharded) -> None:
        """ValueError unless every piece of `layer` falls on block boundaries."""
        for s in layer.shard_ids:
            self._ranges(layer, s)

    def _ranges(self, layer: Sharded, shard_id: ShardId
                ) -> tuple[tuple[int, int], tuple[int, int], int]:
        """This rank's block rows and columns of the part's grid, and where its
        rows start in the parameter."""
        rows = _blocks(layer.output_piece(shard_id), self.block_n, "output rows")
        cols = _blocks(layer.input_piece(), self.block_k, "input features")
        index = layer.shard_ids.index(shard_id)
        return rows, cols, sum(self.part_rows(layer)[:index])

    def _fused_totals(self, layer: Sharded) -> list[int]:
        totals = [layer.output_piece(s).total for s in layer.shard_ids]
        if any(t % self.block_n for t in totals[:-1]):
            raise ValueError(f"a fused checkpoint tensor with parts of {totals} rows: its "
                             f"[{self.block_n}, {self.block_k}] blocks straddle the parts")
        return totals

    @staticmethod
    def _shard(layer: Sharded, shard_id: ShardId) -> ShardId:
        check_shard(layer, shard_id)
        return layer.shard_ids[0] if shard_id is None else shard_id


def _blocks(piece: Piece, block: int, what: str) -> tuple[int, int]:
    """The blocks [b0, b1) holding `piece`; a piece must start on a block and
    end on one or at the end of the axis (the ragged last block)."""
    end = piece.start + piece.size
    if piece.start % block or (end % block and end != piece.total):
        raise ValueError(f"{what} [{piece.start}, {end}) of {piece.total}: a tensor-parallel "
                         f"piece of a block-quantized weight must be whole blocks of {block}")
    return piece.start // block, cdiv(end, block)


class OptionalScalarSpec(WeightSpec):
    """A replicated single number the checkpoint may omit (it then keeps its
    initial value); its checkpoint tensor is () or (1,)."""

    checkpoint_dtypes = FLOAT_DTYPES

    def hf_shape(self, layer: nn.Module, param: nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        self._no_shard(shard_id)
        return (1,)

    def required_shards(self, layer: nn.Module, param: nn.Parameter) -> set[ShardId]:
        return set()

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        self._no_shard(shard_id)
        param.data.copy_(_one_number(loaded, "a scale").reshape(param.shape))

    def gather(self, layer: nn.Module, param: nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        self._no_shard(shard_id)
        return param.data.reshape(1)


OPTIONAL_SCALAR = OptionalScalarSpec()
