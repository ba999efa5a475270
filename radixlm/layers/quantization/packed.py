"""Weights held in the CPU kernels' tile layout (`layers/cpu_ops/qgemm.h`), shared by
the GGUF and int8 methods.

One layer's weight is one flat uint8 parameter, `weight`: for each fused part
(q, k, v; gate, up; one part for an unfused layer), in shard order, that
part's codes, its scales and (asymmetric formats) its mins, byte for byte as
the kernels read them. Bytes, because the parts of one layer may differ in
format and so in scale dtype (a Q4_K_M file's v_proj is Q6_K); one tensor per
checkpoint tensor, so a weight update's backup and a read-back see all of it.
`PackedLayout` says where each region lies and cuts a tensor-parallel rank's
piece out of a whole tensor: whole tiles of 16 rows along the outputs, whole
blocks along the inputs. The method derives `QuantizedWeight` views (no
copies) after loading and multiplies with them, one kernel call per run of
parts in the same format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.layers.cpu_ops import qgemm, qpack
from radixlm.layers.cpu_ops.qgemm import ACT_BLOCK, QuantizedWeight
from radixlm.layers.quantization.base import EmbeddingMethod, LinearMethod
from radixlm.layers.sharding import Piece, ShardId, WeightSpec, copy_checked, gather_pieces

if TYPE_CHECKING:
    from radixlm.layers.linear import LinearBase

TILE = qpack.TILE
F32_SCALES = frozenset({"q4_k", "q5_k", "q6_k", "int8"})
ASYMMETRIC = frozenset({"q4_1", "q4_k", "q5_k"})


@dataclass(frozen=True)
class PackedLayout:
    """Where the bytes of one weight W [n, k] in `format` lie in its flat buffer.
    `k` is a multiple of 32; `in_features` (<= k) what callers pass (int8 pads
    k with zero columns)."""

    format: str
    n: int
    k: int
    in_features: int

    @property
    def tiles(self) -> int:
        return -(-self.n // TILE)

    @property
    def block(self) -> int:
        return qpack.LAYOUT[self.format][1]

    def regions(self) -> list[tuple[int, int]]:
        """(units along k, bytes per tile and unit) of the codes, scales, mins."""
        bits, block, _ = qpack.LAYOUT[self.format]
        blocks = self.k // block
        scale = 4 if self.format in F32_SCALES else 2
        out = [(blocks, TILE * block * bits // 8)]
        out.append((1, TILE * scale) if self.format == "int8" else (blocks, TILE * scale))
        if self.format in ASYMMETRIC:
            out.append((blocks, TILE * scale))
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.tiles * units * size for units, size in self.regions())

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each region of `buf` (1-D uint8, `nbytes` long) as [tiles, units, bytes]."""
        out, start = [], 0
        for units, size in self.regions():
            end = start + self.tiles * units * size
            out.append(buf[start:end].view(self.tiles, units, size))
            start = end
        return out

    def weight(self, buf: torch.Tensor) -> QuantizedWeight:
        """The kernels' view of `buf` (no copy)."""
        scale_dtype = torch.float32 if self.format in F32_SCALES else torch.float16
        regions = [v.reshape(-1) for v in self.views(buf)]
        mins = (regions[2].view(scale_dtype) if len(regions) > 2
                else torch.empty(0, dtype=scale_dtype))
        return QuantizedWeight(self.format, self.n, self.k, self.in_features, regions[0],
                               regions[1].view(scale_dtype), mins)

    def unit_range(self, features: Piece) -> tuple[int, int]:
        """Blocks [b0, b1) holding input features `features` (whole blocks, and a
        multiple of the activations' 32 unless they run to the end)."""
        start, end = features.start, features.start + features.size
        if features.whole:
            return 0, self.k // self.block
        if start % ACT_BLOCK or features.size % ACT_BLOCK:
            raise ValueError(f"input features [{start}, {end}) of a {self.format} weight: a "
                             f"tensor-parallel piece must be whole blocks of {ACT_BLOCK}")
        return start // self.block, end // self.block

    def tile_range(self, rows: Piece) -> tuple[int, int]:
        """Tiles [t0, t1) holding output rows `rows` (whole tiles, the last may be ragged)."""
        start, end = rows.start, rows.start + rows.size
        if start % TILE or (rows.size % TILE and end != rows.total):
            raise ValueError(f"output rows [{start}, {end}) of a {self.format} weight with "
                             f"{rows.total} rows: a tensor-parallel piece must be whole tiles "
                             f"of {TILE} rows")
        return start // TILE, -(-end // TILE)


def packed_bytes(w: QuantizedWeight) -> torch.Tensor:
    """A packed weight as the one byte buffer `PackedLayout` describes."""
    return torch.cat([w.qweight, w.scales.view(torch.uint8), w.mins.view(torch.uint8)])


def why_not_packed(layer: torch.nn.Module, formats: list[str], row_counts: list[int],
                   k_local: int) -> str | None:
    """Why this rank's piece of `layer` (one format per fused part) cannot be
    held packed, or None: pieces must be whole tiles and blocks."""
    try:
        layer_parts(layer, formats, k_local, row_counts)
    except ValueError as e:
        return str(e)
    features = layer.input_piece()
    for shard_id, fmt in zip(layer.shard_ids, formats, strict=True):
        if fmt != "int8" and (k_local % ACT_BLOCK or features.total % qpack.LAYOUT[fmt][1]):
            return (f"{features.total} input features ({k_local} on this rank) are not whole "
                    f"{fmt} blocks and multiples of {ACT_BLOCK}")
        rows = layer.output_piece(shard_id)
        whole = PackedLayout(fmt, rows.total, _padded(features.total, fmt), features.total)
        try:
            whole.tile_range(rows)
            whole.unit_range(features)
        except ValueError as e:
            return str(e)
    return None


def _padded(k: int, fmt: str) -> int:
    return k if fmt != "int8" else -(-k // ACT_BLOCK) * ACT_BLOCK


# ---- one layer's parts ---------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """Consecutive fused parts in one format: one weight for the kernels, its
    bytes from `offset` of the layer's buffer, its outputs from `column`."""

    layout: PackedLayout
    offset: int
    column: int

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return self.layout.views(buf[self.offset:self.offset + self.layout.nbytes])


@dataclass(frozen=True)
class Part:
    """One fused part on this rank: tiles [tile, tile + its tiles) of run `run`."""

    shard_id: ShardId
    run: int
    tile: int
    layout: PackedLayout  # the part alone (its rows), for sizes


def layer_parts(layer: torch.nn.Module, formats: list[str], k_local: int,
                row_counts: list[int]) -> tuple[list[Run], list[Part]]:
    """The runs and parts of `layer` (one part per shard id, in order) with these
    formats and rows. A part followed by another in its run must be whole tiles."""
    runs: list[Run] = []
    parts: list[Part] = []
    offset = column = 0
    i = 0
    while i < len(formats):
        j = i
        while j + 1 < len(formats) and formats[j + 1] == formats[i]:
            j += 1
        fmt, k = formats[i], _padded(k_local, formats[i])
        tile = 0
        for s in range(i, j + 1):
            if s < j and row_counts[s] % TILE:
                raise ValueError(f"a fused part of {row_counts[s]} rows is not whole tiles of "
                                 f"{TILE}")
            layout = PackedLayout(fmt, row_counts[s], k, k_local)
            parts.append(Part(layer.shard_ids[s], len(runs), tile, layout))
            tile += layout.tiles
        run = Run(PackedLayout(fmt, sum(row_counts[i:j + 1]), k, k_local), offset, column)
        runs.append(run)
        offset += run.layout.nbytes
        column += run.layout.n
        i = j + 1
    return runs, parts


def part_views(buf: torch.Tensor, runs: list[Run], part: Part) -> list[torch.Tensor]:
    """The part's tiles of each region of its run."""
    return [v[part.tile:part.tile + part.layout.tiles] for v in runs[part.run].views(buf)]


def _part(parts: list[Part], shard_id: ShardId) -> Part:
    for part in parts:
        if part.shard_id == shard_id:
            return part
    raise ValueError(f"shard {shard_id!r} is not one of {[p.shard_id for p in parts]}")


class PackedSpec(WeightSpec):
    """A packed `weight` whose checkpoint tensors are packed too: per fused part,
    the whole tensor's bytes (all ranks' rows and features) in `PackedLayout`
    order, 1-D uint8. This rank's tiles and blocks are cut from it."""

    checkpoint_dtypes = frozenset({torch.uint8})

    def __init__(self, runs: list[Run], parts: list[Part]) -> None:
        self.runs = runs
        self.parts = parts

    def whole(self, layer: torch.nn.Module, part: Part) -> PackedLayout:
        """The layout of the part's whole checkpoint tensor (every rank's piece)."""
        rows, features = layer.output_piece(part.shard_id), layer.input_piece()
        fmt = part.layout.format
        return PackedLayout(fmt, rows.total, _padded(features.total, fmt), features.total)

    def hf_shape(self, layer: torch.nn.Module, param: torch.nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        return (self.whole(layer, self._one(shard_id)).nbytes,)

    def required_shards(self, layer: torch.nn.Module, param: torch.nn.Parameter
                        ) -> set[ShardId]:
        return set(layer.shard_ids)

    def load(self, layer: torch.nn.Module, param: torch.nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        part = self._one(shard_id)
        whole = self.whole(layer, part)
        if loaded.dim() != 1 or loaded.numel() != whole.nbytes:
            raise ValueError(f"packed {whole.format} tensor of shape {tuple(loaded.shape)}: "
                             f"expected ({whole.nbytes},) for a [{whole.n}, {whole.k}] weight")
        (t0, t1), units = self._ranges(layer, part, whole)
        sources = whole.views(loaded.to("cpu").contiguous())
        for dst, src, (u0, u1) in zip(part_views(param.data, self.runs, part), sources, units,
                                      strict=True):
            # An embedding's last rank holds fewer rows than its padded table.
            copy_checked(dst[:t1 - t0], src[t0:t1, u0:u1])

    def gather(self, layer: torch.nn.Module, param: torch.nn.Parameter,
               shard_id: ShardId) -> torch.Tensor:
        part = self._one(shard_id)
        whole = self.whole(layer, part)
        (t0, t1), units = self._ranges(layer, part, whole)
        rows = layer.output_piece(part.shard_id)
        out = []
        for local, (u0, u1), (total_units, _) in zip(part_views(param.data, self.runs, part),
                                                     units, whole.regions(), strict=True):
            local = local[:t1 - t0]
            if not rows.whole:
                local = gather_pieces(local, t0, 0, whole.tiles)
            if u1 - u0 != total_units:
                local = gather_pieces(local, u0, 1, total_units)
            out.append(local.reshape(-1))
        return torch.cat(out)

    def _one(self, shard_id: ShardId) -> Part:
        if shard_id is None and len(self.parts) > 1:
            raise ValueError(f"a packed weight of {len(self.parts)} fused parts has no single "
                             f"checkpoint tensor: its parts are "
                             f"{[p.shard_id for p in self.parts]}")
        return self.parts[0] if shard_id is None else _part(self.parts, shard_id)

    @staticmethod
    def _ranges(layer: torch.nn.Module, part: Part, whole: PackedLayout
                ) -> tuple[tuple[int, int], list[tuple[int, int]]]:
        """This rank's tiles, and per region its units along k (a per-channel
        scale region has one unit, whole on every rank)."""
        rows, features = layer.output_piece(part.shard_id), layer.input_piece()
        blocks = whole.unit_range(features)
        units = [blocks if n > 1 or i == 0 else (0, 1)
                 for i, (n, _) in enumerate(whole.regions())]
        return whole.tile_range(rows), units


# ---- the method ----------------------------------------------------------------------
class PackedLinearMethod(LinearMethod):
    """Products through the quantized kernels from one packed `weight` (see the
    module docstring); `formats`: one per fused part. Subclasses choose the
    parameter's spec, i.e. what the checkpoint holds."""

    spec_class: type[PackedSpec] = PackedSpec
    batch_invariant = True  # every output of qgemm is one row's own chain (test_qgemm_threads)
    on_product_pool = True

    def __init__(self, formats: list[str]) -> None:
        self.formats = formats

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype) -> None:
        if params_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"quantized CPU weights compute in float32 or bfloat16, not "
                             f"{params_dtype} (pass --dtype float32 or bfloat16)")
        runs, parts = layer_parts(layer, self.formats, input_size_per_partition,
                                  output_partition_sizes)
        # Zeros: rows past a vocabulary (padding) are never loaded and must read as 0.
        nbytes = sum(run.layout.nbytes for run in runs)
        weight = torch.zeros(nbytes, dtype=torch.uint8, device="cpu")
        layer.add_weight("weight", weight, self.spec_class(runs, parts))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The layout lives in the weight's spec: an LM head's method reads the
        # table its embedding created (tied or not), never creating one itself.
        buf, runs = layer.weight.data, layer.weight.weight_spec.runs
        layer.packed_runs = [(run.layout.weight(buf[run.offset:run.offset + run.layout.nbytes]),
                              run.column, run.column + run.layout.n) for run in runs]

    def drop_derived(self, layer: torch.nn.Module) -> None:
        layer.packed_runs = None

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        runs = layer.packed_runs
        assert runs is not None, "process_weights_after_loading has not run on this layer"
        if len(runs) == 1 and out is None:
            y = qgemm.linear(x, runs[0][0])
        else:
            n = runs[-1][2]
            x2 = x.reshape(-1, x.shape[-1])
            act = qgemm.quantize_activations(x2, runs[0][0])
            y = out.view(x2.shape[0], n) if out is not None else x2.new_empty(x2.shape[0], n)
            for w, c0, c1 in runs:
                qgemm.gemm_into(act, w, y[:, c0:c1])
            y = y.view(*x.shape[:-1], n)
        if bias is not None:
            y.add_(bias)
        return out if out is not None else y


class PackedEmbeddingMethod(EmbeddingMethod):
    """An embedding table held packed in one format: lookups dequantize their rows."""

    def __init__(self, linear: PackedLinearMethod) -> None:
        self.linear = linear

    def create_weights(self, layer: torch.nn.Module, embedding_dim: int, num_rows: int,
                       params_dtype: torch.dtype) -> None:
        self.linear.create_weights(layer, embedding_dim, [num_rows], params_dtype)

    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        runs = layer.packed_runs
        assert runs is not None, "process_weights_after_loading has not run on this layer"
        return qgemm.dequantize(runs[0][0], ids, dtype=layer.params_dtype)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.linear.process_weights_after_loading(layer)

    def drop_derived(self, layer: torch.nn.Module) -> None:
        self.linear.drop_derived(layer)
