"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank holds rows of the
weight), row-parallel layers split the input features (each rank holds columns
and the partial products are summed with an all-reduce). Every parameter
carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the
*full* tensor from an HF checkpoint and copies this rank's piece into place;
fused layers use `shard_id` to say which of the fused projections it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm import distributed as tp
from radixlm.layers.gemv import gemv, use_gemv

# ---- CPU: bf16 weights prepacked for oneDNN ---------------------------------------------
_PACKED = "_radixlm_onednn"  # the attribute holding a weight's (data_ptr, packed copy)
_PACKED_HALVES = "_radixlm_onednn_halves"  # (data_ptr, (packed gate, packed up))
_prepack = {"enabled": True}
_gemv = {"enabled": True}


def set_gemv(enabled: bool) -> None:
    _gemv["enabled"] = enabled


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _gemv["enabled"] and use_gemv(x, weight)


def set_weight_prepack(enabled: bool) -> None:
    _prepack["enabled"] = enabled


@functools.cache
def _onednn_bf16() -> bool:
    """Whether this CPU and torch build run oneDNN in bf16 (asked once per process)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _can_prepack(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_prepack["enabled"] and x.device.type == "cpu" and weight.dtype == torch.bfloat16
            and x.dtype == torch.bfloat16 and _onednn_bf16())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with two exceptions (and `out`: a contiguous CUDA tensor to write
    the result into, for callers that need it in a given place).

    - On CUDA with 1-8 rows (decode at small batch), our Triton GEMV
      (`layers.gemv`) on the shapes where it measured faster than cuBLAS.
    - On the CPU in bf16, the weight is read from a copy reordered once into
      oneDNN's blocked layout (what torch.compile's CPU freezing does). Given
      the plain [out, in] weight, every call pays that layout work again: the
      copy makes this machine's decode step 8-15 ms faster (of ~140 ms at 64
      requests of SmolLM2) and single-row products twice as fast; the results
      are bitwise the same. The copy costs the weight's memory once more, and
      is dropped whenever weights are loaded (`drop_packed_weights`)."""
    if x.is_cuda:
        if _takes_gemv(x, weight):
            return gemv(x, weight, bias, out=out)
        if out is None:
            return F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        y = out.view(x2.shape[0], weight.shape[0])
        if bias is None:
            torch.mm(x2, weight.t(), out=y)
        else:
            torch.addmm(bias, x2, weight.t(), out=y)
        return out
    assert out is None, "out= is for CUDA tensors"
    if not _can_prepack(x, weight):
        return F.linear(x, weight, bias)
    packed = _packed(weight, _PACKED, _pack)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def _packed(weight: torch.Tensor, attr: str, make: Callable[[torch.Tensor], Any]) -> Any:
    """make(weight), cached on the parameter under `attr` until its storage changes
    (or `drop_packed_weights` forgets it)."""
    cached = getattr(weight, attr, None)
    if cached is None or cached[0] != weight.data_ptr():
        cached = (weight.data_ptr(), make(weight.detach()))
        setattr(weight, attr, cached)
    return cached[1]


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """silu(x G^T) * (x U^T) for a merged weight [G; U] (gate_up_proj), or None
    when the caller must run the matmul and the activation itself.

    - On CUDA with 1-8 rows, where `linear` would take our GEMV: the GEMV
      computes matching gate and up columns and applies the activation in
      registers, one launch instead of two per MLP, same bits.
    - On the CPU in bf16, oneDNN applies silu to the gate product and the
      multiply to the up product as they are written (post-ops), so the
      [tokens, 2 * d] intermediate is never stored and re-read: ~14 of ~99 ms
      per MLP of 8192 prefill tokens (SmolLM2), same speed in decode. silu(gate)
      is rounded to bf16 before the multiply, one rounding more than the
      unfused kernel."""
    if x.is_cuda:
        if _takes_gemv(x, weight):
            return gemv(x, weight, silu_mul=True)
        return None
    if not _can_prepack(x, weight):
        return None
    gate, up = _packed(weight, _PACKED_HALVES,
                       lambda w: tuple(_pack(half) for half in w.chunk(2, dim=0)))
    x = x.contiguous()
    g = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, g, up, None, "mul")


def drop_packed_weights(model: nn.Module) -> None:
    """Forget the prepacked copies: the next call repacks from the weights as they
    are now. Weight loads write in place, which keeps the data pointer, so every
    path that changes weights must call this."""
    for param in model.parameters():
        for attr in (_PACKED, _PACKED_HALVES):
            if hasattr(param, attr):
                delattr(param, attr)


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


def take_shard(loaded: torch.Tensor, dim: int, index: int, size: int, total: int) -> torch.Tensor:
    """Piece `index` of length `size` along `dim` of a checkpoint tensor of length `total`."""
    if loaded.shape[dim] != total:
        raise ValueError(f"checkpoint tensor has {loaded.shape[dim]} entries along dim {dim}, "
                         f"expected {total}")
    return loaded.narrow(dim, index * size, size)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor,
                          shard_id: object = None) -> None:
    """For replicated parameters (norms): the whole tensor on every rank."""
    copy_checked(param.data, loaded)


def _new_param(*shape: int, dtype: torch.dtype | None, loader: object) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split evenly across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None,
                 local_output_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp.get_tp_rank(), tp.get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = local_output_size or divide(output_size, self.tp_size)
        self.gather_output = gather_output
        self.weight = _new_param(self.output_size_per_partition, input_size, dtype=params_dtype,
                                 loader=self.weight_loader)
        self.bias = (_new_param(self.output_size_per_partition, dtype=params_dtype,
                                loader=self.weight_loader) if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        size = param.shape[0]
        copy_checked(param.data, take_shard(loaded, 0, self.tp_rank, size, size * self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        return tp.tensor_model_parallel_all_gather(out, -1) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one weight
    (gate_proj and up_proj -> gate_up_proj). Each rank holds its slice of every
    projection, back to back, so the split after the matmul is local."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, params_dtype=params_dtype)
        for size in self.output_sizes:
            divide(size, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        if shard_id is None:  # the checkpoint already stores the merged tensor
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        piece = take_shard(loaded, 0, self.tp_rank, size, self.output_sizes[shard_id])
        copy_checked(param.data.narrow(0, offset, size), piece)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused into one matmul, split by attention head as
    `head_partition` says (KV heads replicated when fewer than the ranks)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.q_start, self.num_heads, self.kv_start, self.num_kv_heads = head_partition(
            total_num_heads, self.total_num_kv_heads, tp.get_tp_size(), tp.get_tp_rank())
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        total = (total_num_heads + 2 * self.total_num_kv_heads) * head_size
        super().__init__(hidden_size, total, bias=bias, params_dtype=params_dtype,
                         local_output_size=self.q_size + 2 * self.kv_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | None = None) -> None:
        hd = self.head_size
        if shard_id is None:  # a checkpoint with a fused qkv tensor
            total_kv = self.total_num_kv_heads * hd
            sizes = [self.total_num_heads * hd, total_kv, total_kv]
            for sid, part in zip("qkv", loaded.split(sizes, dim=0), strict=True):
                self.weight_loader(param, part, sid)
            return
        offset, size, first, total = {
            "q": (0, self.q_size, self.q_start, self.total_num_heads),
            "k": (self.q_size, self.kv_size, self.kv_start, self.total_num_kv_heads),
            "v": (self.q_size + self.kv_size, self.kv_size, self.kv_start,
                  self.total_num_kv_heads),
        }[shard_id]
        if loaded.shape[0] != total * hd:
            raise ValueError(f"checkpoint tensor has {loaded.shape[0]} rows for {shard_id}, "
                             f"expected {total * hd}")
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, first * hd, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; partial sums are
    all-reduced, and the bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_is_parallel: bool = True, reduce_results: bool = True,
                 params_dtype: torch.dtype | None = None,
                 input_partition: tuple[int, int] | None = None) -> None:
        """`input_partition` (start, size): this rank's input columns when they are
        not an even split (attention heads cut unevenly)."""
        super().__init__()
        self.tp_rank, self.tp_size = tp.get_tp_rank(), tp.get_tp_size()
        self.input_size = input_size
        if input_partition is None:
            size = divide(input_size, self.tp_size)
            input_partition = (self.tp_rank * size, size)
        self.input_start, self.input_size_per_partition = input_partition
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.weight = _new_param(output_size, self.input_size_per_partition, dtype=params_dtype,
                                 loader=self.weight_loader)
        self.bias = (_new_param(output_size, dtype=params_dtype, loader=self.weight_loader)
                     if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        if param.dim() == 1:  # the bias is not split
            copy_checked(param.data, loaded)
            return
        if loaded.shape[1] != self.input_size:
            raise ValueError(f"checkpoint tensor has {loaded.shape[1]} columns, expected "
                             f"{self.input_size}")
        copy_checked(param.data, loaded.narrow(1, self.input_start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias)
        if not self.input_is_parallel:
            x = x.narrow(-1, self.input_start, self.input_size_per_partition)
        if self.reduce_results:
            out = tp.tensor_model_parallel_all_reduce(linear(x, self.weight))
            return out if self.bias is None else out + self.bias
        # The consumer sums the partials (maybe fused with its norm, from the buffer
        # every rank writes in the same order): only rank 0 adds the bias, in place.
        buf = tp.partial_sum_buffer((*x.shape[:-1], self.output_size), x.dtype, x.device)
        return linear(x, self.weight, self.bias if self.tp_rank == 0 else None, out=buf)
