"""How a parameter relates to the whole tensors of an HF checkpoint under tensor parallelism.

Two halves, so that a layer and a weight method can each own what is theirs:

- A layer owns its *partition*: which part of each whole checkpoint tensor
  this rank holds, in logical (unquantized) coordinates. It answers
  `shard_ids` (the fused parts a checkpoint writes separately: "q"/"k"/"v",
  0/1; `(None,)` when there is one) and `output_piece(shard_id)` /
  `input_piece()`, a `Piece` along the output features and along the input
  features. `Sharded` (the base of the parallel layers) declares them.
- A parameter carries a `WeightSpec` (`param.weight_spec`), chosen by whoever
  created it (the layer for its bias, the linear method for the rest): which
  of its dims run along the layer's output and input features, how many
  logical elements one stored element holds there (packed quantized weights),
  and which checkpoint dtypes it takes. From the layer's pieces and its spec
  a parameter loads its slice of a whole tensor, answers the whole tensor's
  shape, and gathers the whole tensor back from every rank.

A parameter without a spec (a norm's weight) is replicated: every rank holds
the whole tensor (`REPLICATED`). A method whose parameters relate to the
checkpoint differently (a per-tensor scale per fused part, say) subclasses
`WeightSpec`.

A mixture-of-experts layer stacks its experts' weights along a leading expert
axis ([local experts, out, in]). Its partition is one `ExpertPartition` per
stacked weight: which experts this rank holds (expert parallelism) and, per
expert, its pieces along the outputs and inputs (tensor parallelism over the
experts' intermediate dimension). `ExpertSpec` maps such a stack onto the
checkpoint: each expert's slice through the spec a dense weight of that
method would have, with shard ids (expert, part) for one expert's tensor and
None for the whole stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from radixlm import distributed as tp

# A fused part ("q", 0, ...), an expert's part (expert, part), or None (the whole tensor).
ShardId = str | int | tuple[int, "str | int | None"] | None
# Checkpoint dtypes an unquantized weight is read from (converted to the model's dtype).
FLOAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class Piece:
    """This rank's part of one axis of a whole checkpoint tensor: entries
    [start, start + size) of `total`, stored from index `offset` of the
    parameter's axis. Where one rank holds the whole axis (size == total),
    every rank does (an axis the layer does not split)."""

    total: int
    start: int
    size: int
    offset: int = 0

    @property
    def whole(self) -> bool:
        return self.size == self.total


class Sharded(Protocol):
    """What a layer answers about its partition (see the module docstring)."""

    shard_ids: tuple[ShardId, ...]

    def output_piece(self, shard_id: ShardId) -> Piece: ...

    def input_piece(self) -> Piece: ...


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of piece `index` when `total` items are cut into `parts` pieces
    as evenly as possible (the first `total % parts` pieces get one more)."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


def head_partition(num_heads: int, num_kv_heads: int, tp_size: int,
                   rank: int) -> tuple[int, int, int, int]:
    """(first q head, q heads, first kv head, kv heads) of a tensor-parallel rank.

    Ranks split the KV heads as evenly as possible and take the query heads
    grouped with them, so head counts need not divide the rank count (SmolLM2's
    9 query / 3 KV heads run on 2 ranks as 6+3 / 2+1). With fewer KV heads than
    ranks each KV head is replicated on tp_size / num_kv_heads ranks, which split
    its query group between them."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of "
                         f"{num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv_start, kv_count = even_split(num_kv_heads, tp_size, rank)
        return kv_start * group, kv_count * group, kv_start, kv_count
    if tp_size % num_kv_heads or group < tp_size // num_kv_heads:
        raise ValueError(f"cannot split {num_heads} attention heads with {num_kv_heads} KV "
                         f"heads over {tp_size} tensor-parallel ranks")
    replicas = tp_size // num_kv_heads
    kv_head = rank // replicas
    q_start, q_count = even_split(group, replicas, rank % replicas)
    return kv_head * group + q_start, q_count, kv_head, 1


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    # copy_ broadcasts silently; a checkpoint of the wrong shape must fail loudly.
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit "
                         f"parameter slice of shape {tuple(dst.shape)}")
    dst.copy_(src)


def gather_pieces(local: torch.Tensor, start: int, dim: int, total: int,
                  group: Any = None) -> torch.Tensor:
    """Reassemble a tensor split along `dim` across the ranks of `group` (default:
    the tensor-parallel group), where this rank holds `local`, starting at
    `start`. Pieces may differ in size (heads split unevenly) and overlap
    (replicated KV heads). A collective: every rank of the group calls it, in
    the same order."""
    world = tp.group_size(group)
    if world == 1:
        return local
    if local.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # collectives move bytes
        whole = gather_pieces(local.view(torch.uint8), start, dim, total)
        return whole.view(local.dtype)
    rows = local.movedim(dim, 0)
    meta = torch.tensor([start, rows.shape[0]], dtype=torch.int64, device=local.device)
    metas = tp.all_gather(meta, 0, group).view(world, 2).tolist()
    width = max(size for _, size in metas)
    padded = rows.new_zeros((width, *rows.shape[1:]))
    padded[:rows.shape[0]] = rows
    chunks = tp.all_gather(padded, 0, group).chunk(world, 0)
    out = rows.new_empty((total, *rows.shape[1:]))
    for chunk, (first, size) in zip(chunks, metas, strict=True):
        out[first:first + size] = chunk[:size]
    return out.movedim(0, dim)


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")



def check_shard(layer: Any, shard_id: ShardId) -> None:
    """ValueError unless `shard_id` is None or one of the layer's fused parts."""
    if shard_id is not None and shard_id not in layer.shard_ids:
        raise ValueError(f"shard {shard_id!r} is not one of this layer's "
                         f"{list(layer.shard_ids)}")


def layer_shards(layer: Any, shard_id: ShardId) -> tuple[ShardId, ...]:
    """The parts a checkpoint tensor for `shard_id` covers (None: all of them)."""
    check_shard(layer, shard_id)
    return layer.shard_ids if shard_id is None else (shard_id,)

class WeightSpec:
    """A replicated parameter: the checkpoint tensor is the parameter, whole, on
    every rank, with no shard ids. Subclasses map split or quantized
    parameters; every method gets the owning layer (for its pieces) and the
    parameter, and `shard_id` as the checkpoint name resolved it."""

    checkpoint_dtypes: frozenset[torch.dtype] = FLOAT_DTYPES

    def hf_shape(self, layer: nn.Module, param: nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor (all ranks together)."""
        self._no_shard(shard_id)
        return tuple(param.shape)

    def required_shards(self, layer: nn.Module, param: nn.Parameter) -> set[ShardId]:
        """The shard ids a complete checkpoint writes into `param` (None: one
        tensor, or the fused tensor whole)."""
        return {None}

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        """Copy this rank's part of the whole checkpoint tensor `loaded` (any
        device, a dtype in `checkpoint_dtypes`) into `param`, in place."""
        self._no_shard(shard_id)
        copy_checked(param.data, loaded)

    def gather(self, layer: nn.Module, param: nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        """The whole checkpoint tensor, in the checkpoint's layout. A collective
        under tensor parallelism: every rank calls it, in the same order."""
        self._no_shard(shard_id)
        return param.data

    @staticmethod
    def _no_shard(shard_id: ShardId) -> None:
        if shard_id is not None:
            raise ValueError(f"shard {shard_id!r} given for a parameter that has no shards")


REPLICATED = WeightSpec()


@dataclass(frozen=True)
class AxisSpec(WeightSpec):
    """A parameter whose dim `output_dim` runs along the layer's output features
    and `input_dim` along its input features (None: neither), split as the
    layer's pieces say. `input_packing` (logical, stored): along the input dim,
    `logical` features are stored in `stored` elements (8 int4 values in one
    int32: (8, 1); a GGUF Q4_0 block of 32 weights in 18 bytes: (32, 18); one
    scale per group of 128: (128, 1)); pieces along it must then fall on whole
    groups. `output_packing`: the same along the output dim (AWQ's qweight and
    the int4 formats' qzeros hold 8 output features per int32)."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    input_packing: tuple[int, int] | None = None
    checkpoint_dtypes: frozenset[torch.dtype] = FLOAT_DTYPES
    output_packing: tuple[int, int] | None = None

    def hf_shape(self, layer: Sharded, param: nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        shape = list(param.shape)
        if self.output_dim is not None:
            shape[self.output_dim] = sum(self._output_piece(layer, s).total
                                         for s in self._shards(layer, shard_id))
        if self.input_dim is not None:
            shape[self.input_dim] = self._input_piece(layer).total
        return tuple(shape)

    def required_shards(self, layer: Sharded, param: nn.Parameter) -> set[ShardId]:
        return set(layer.shard_ids) if self.output_dim is not None else {None}

    def load(self, layer: Sharded, param: nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        shards = self._shards(layer, shard_id)
        if len(shards) > 1:  # the checkpoint stores the fused tensor whole
            totals = [self._output_piece(layer, s).total for s in shards]
            _check_length(loaded, self.output_dim, sum(totals), shard_id)
            for s, part in zip(shards, loaded.split(totals, self.output_dim), strict=True):
                self.load(layer, param, part, s)
            return
        dst, src = param.data, loaded
        for dim, piece in self._pieces(layer, shards[0]):
            _check_length(src, dim, piece.total, shards[0])
            src = src.narrow(dim, piece.start, piece.size)
            dst = dst.narrow(dim, piece.offset, piece.size)
        copy_checked(dst, src)

    def gather(self, layer: Sharded, param: nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        parts = []
        for s in self._shards(layer, shard_id):
            local = param.data
            for dim, piece in self._pieces(layer, s):
                local = local.narrow(dim, piece.offset, piece.size)
                if not piece.whole:
                    local = gather_pieces(local, piece.start, dim, piece.total,
                                          getattr(layer, "group", None))
            parts.append(local)
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.output_dim)

    def _shards(self, layer: Sharded, shard_id: ShardId) -> tuple[ShardId, ...]:
        if self.output_dim is None:
            self._no_shard(shard_id)
            return (None,)
        return layer_shards(layer, shard_id)

    def _pieces(self, layer: Sharded, shard_id: ShardId) -> list[tuple[int, Piece]]:
        pieces = []
        if self.output_dim is not None:
            pieces.append((self.output_dim, self._output_piece(layer, shard_id)))
        if self.input_dim is not None:
            pieces.append((self.input_dim, self._input_piece(layer)))
        return pieces

    def _input_piece(self, layer: Sharded) -> Piece:
        return _packed_piece(layer.input_piece(), self.input_packing, "input")

    def _output_piece(self, layer: Sharded, shard_id: ShardId) -> Piece:
        return _packed_piece(layer.output_piece(shard_id), self.output_packing, "output")


def _packed_piece(piece: Piece, packing: tuple[int, int] | None, axis: str) -> Piece:
    """`piece` in stored elements of a packed axis (itself when unpacked)."""
    if packing is None:
        return piece
    logical, stored = packing
    for n in (piece.total, piece.start, piece.size, piece.offset):
        if n % logical:
            raise ValueError(f"{axis} features {piece} do not fall on whole groups of "
                             f"{logical} packed values")
    return Piece(*(n // logical * stored for n in (piece.total, piece.start, piece.size,
                                                   piece.offset)))


def _check_length(t: torch.Tensor, dim: int | None, expected: int, shard_id: ShardId) -> None:
    if dim is not None and t.shape[dim] != expected:
        part = f" for shard {shard_id!r}" if shard_id is not None else ""
        raise ValueError(f"checkpoint tensor has {t.shape[dim]} entries along dim {dim}{part}, "
                         f"expected {expected}")


@dataclass(frozen=True)
class ExpertPartition:
    """One stacked weight of a MoE layer as this rank holds it: experts
    [experts.start, experts.start + experts.size) of `experts.total`, stored
    from local index 0, and per expert the `Sharded` pieces of a dense weight
    (`shard_ids`, one output piece per shard id, the input piece). `group`:
    the ranks that split one expert's tensor (None: the tensor-parallel group;
    under expert parallelism the ranks holding the same experts)."""

    shard_ids: tuple[ShardId, ...]
    outputs: tuple[Piece, ...]
    input: Piece
    experts: Piece
    group: Any = None

    def output_piece(self, shard_id: ShardId) -> Piece:
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard {shard_id!r} is not one of this expert weight's "
                             f"{list(self.shard_ids)}")
        return self.outputs[self.shard_ids.index(shard_id)]

    def input_piece(self) -> Piece:
        return self.input

    def local_index(self, expert: int) -> int | None:
        """Where global expert `expert` is stored here; None: on another rank."""
        if not 0 <= expert < self.experts.total:
            raise ValueError(f"expert {expert} is out of range [0, {self.experts.total})")
        local = expert - self.experts.start
        return local if 0 <= local < self.experts.size else None


class ExpertSpec(WeightSpec):
    """A stack of expert weights along dim 0 ([local experts, ...]), each
    expert's slice mapped to the checkpoint by `inner` (the spec a dense
    weight of the same method has) under the partition's per-expert pieces.

    Shard ids: (expert, part) for global expert `expert`'s checkpoint tensor
    of fused part `part` (0 / 1: gate / up; None: an unfused weight), None
    for the whole stack [num_experts, ...] (transformers' fused
    `experts.gate_up_proj`). An expert another rank holds loads as nothing,
    and is read back from that rank."""

    def __init__(self, inner: WeightSpec, partition: ExpertPartition) -> None:
        self.inner = inner
        self.partition = partition

    @property
    def checkpoint_dtypes(self) -> frozenset[torch.dtype]:  # type: ignore[override]
        return self.inner.checkpoint_dtypes

    def hf_shape(self, layer: nn.Module, param: nn.Parameter,
                 shard_id: ShardId) -> tuple[int, ...]:
        expert, part = self._split(shard_id)
        one = self.inner.hf_shape(self.partition, param.data[0], part)
        return one if expert is not None else (self.partition.experts.total, *one)

    def required_shards(self, layer: nn.Module, param: nn.Parameter) -> set[ShardId]:
        experts = self.partition.experts
        parts = self.inner.required_shards(self.partition, param.data[0])
        return {(e, p) for e in range(experts.start, experts.start + experts.size)
                for p in parts}

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
             shard_id: ShardId) -> None:
        expert, part = self._split(shard_id)
        experts = self.partition.experts
        if expert is None:
            _check_length(loaded, 0, experts.total, shard_id)
            for local in range(experts.size):
                self.inner.load(self.partition, param.data[local],
                                loaded[experts.start + local], part)
            return
        local = self.partition.local_index(expert)
        if local is not None:
            self.inner.load(self.partition, param.data[local], loaded, part)

    def gather(self, layer: nn.Module, param: nn.Parameter, shard_id: ShardId) -> torch.Tensor:
        expert, part = self._split(shard_id)
        if expert is None:
            return torch.stack([self._gather_one(param, e, part)
                                for e in range(self.partition.experts.total)])
        return self._gather_one(param, expert, part)

    def knows(self, shard_id: ShardId) -> bool:
        """Whether `shard_id` names one of the model's experts (any rank's)."""
        expert, _ = self._split(shard_id)
        return expert is None or 0 <= expert < self.partition.experts.total

    def holds(self, shard_id: ShardId) -> bool:
        """Whether this rank holds any of the checkpoint tensor `shard_id`."""
        expert, _ = self._split(shard_id)
        return expert is None or self.partition.local_index(expert) is not None

    def _gather_one(self, param: nn.Parameter, expert: int, part: ShardId) -> torch.Tensor:
        local = self.partition.local_index(expert)
        ep = tp.moe_parallel()
        if ep.ep_size == 1:
            return self.inner.gather(self.partition, param.data[local], part)
        # The owning ranks assemble it among themselves, then the first of them sends it.
        if local is not None:
            whole = self.inner.gather(self.partition, param.data[local], part).contiguous()
        else:
            # What the owners' gather gives: the parameter's dtype, or the floats a
            # spec reads back instead (`gather_dtype`: FP8 codes quantized at load).
            dtype = getattr(self.inner, "gather_dtype", None) or param.dtype
            whole = torch.empty(self.inner.hf_shape(self.partition, param.data[0], part),
                                dtype=dtype, device=param.device)
        return tp.broadcast_from(whole, ep.owner_rank(expert, self.partition.experts.total))

    @staticmethod
    def _split(shard_id: ShardId) -> tuple[int | None, ShardId]:
        if shard_id is None:
            return None, None
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2
                and isinstance(shard_id[0], int)):
            raise ValueError(f"shard {shard_id!r} of a stacked expert weight: expected "
                             "(expert, part) or None")
        return shard_id


def weight_spec(param: nn.Parameter) -> WeightSpec:
    """The parameter's spec (REPLICATED when it was created without one)."""
    return getattr(param, "weight_spec", REPLICATED)


def check_checkpoint_dtype(name: str, param: nn.Parameter, dtype: torch.dtype | str) -> None:
    """ValueError unless the checkpoint may hold `param`'s tensor `name` in `dtype`
    (a torch dtype, or a safetensors header dtype such as 'F8_E4M3')."""
    if isinstance(dtype, str):
        dtype = SAFETENSORS_DTYPES.get(dtype, dtype)
    accepted = weight_spec(param).checkpoint_dtypes
    if dtype in accepted:
        return
    want = ", ".join(sorted(dtype_name(d) for d in accepted))
    floats_only = accepted <= FLOAT_DTYPES
    is_float = isinstance(dtype, torch.dtype) and dtype.is_floating_point
    why = "not a floating-point type" if floats_only and not is_float else \
        "which its parameter does not take"
    message = (f"checkpoint tensor {name} has dtype {dtype_name(dtype)}, {why} (expected one "
               f"of {want})")
    if floats_only and dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        message += ("; FP8 weights load through an FP8 method, which a checkpoint declares in "
                    "its config.json's quantization_config (fp8 or compressed-tensors), and "
                    "this layer has none")
    raise ValueError(message)


# safetensors header dtype -> torch dtype, for checking headers without reading data.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def register_weight(module: nn.Module, name: str, data: torch.Tensor,
                    spec: WeightSpec) -> nn.Parameter:
    """Register `data` as `module`'s parameter `name`, mapped to the checkpoint by
    `spec` and loaded through `module.weight_loader`."""
    param = nn.Parameter(data, requires_grad=False)
    param.weight_spec = spec
    param.weight_loader = module.weight_loader
    module.register_parameter(name, param)
    return param
