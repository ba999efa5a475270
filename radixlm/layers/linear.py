"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank holds rows of the
weight), row-parallel layers split the input features (each rank holds columns
and the partial products are summed with an all-reduce). A layer owns its
partition (`output_piece` / `input_piece`, `layers/sharding.py`) and its bias;
its `quant_method` (`layers/quantization/`), chosen per layer when the model
is built, owns the weight: its parameters, what is derived from them after
loading, and the product. Every parameter's `weight_loader(param, tensor,
shard_id)` takes the *whole* checkpoint tensor and copies this rank's piece
into place; fused layers use `shard_id` to say which of the fused projections
it is.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm import distributed as tp
from radixlm.layers import split_sums
from radixlm.layers.activation import SiluAndMul
from radixlm.layers.fp8_rows import Fp8Rows, to_fp8_rows
from radixlm.layers.norm_fold import FoldedNorm, NormTarget
from radixlm.layers.quantization import QuantizationConfig, UnquantizedConfig
from radixlm.layers.sharding import (
    AxisSpec,
    Piece,
    ShardId,
    WeightSpec,
    divide,
    head_partition,
    register_weight,
    weight_spec,
)
from radixlm.layers.split_sums import SplitSums


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor,
                          shard_id: object = None) -> None:
    """For replicated parameters (norms): the whole tensor on every rank."""
    weight_spec(param).load(None, param, loaded, shard_id)


class LinearBase(nn.Module):
    """y = x W^T + b on one tensor-parallel rank. Subclasses set their partition
    and call `_create_weights` at the end of their constructor."""

    shard_ids: tuple[ShardId, ...] = (None,)

    def __init__(self, input_size: int, output_size: int, params_dtype: torch.dtype | None,
                 prefix: str) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp.get_tp_rank(), tp.get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix

    def _create_weights(self, quant_config: QuantizationConfig | None,
                        input_size_per_partition: int, output_partition_sizes: list[int],
                        bias: bool) -> None:
        self.quant_method = (quant_config or UnquantizedConfig()).get_linear_method(
            self, self.prefix)
        self.quant_method.create_weights(self, input_size_per_partition, output_partition_sizes,
                                         self.params_dtype)
        if bias:
            self.add_weight("bias", torch.empty(sum(output_partition_sizes),
                                                dtype=self.params_dtype),
                            AxisSpec(output_dim=0, input_dim=None))
        else:
            self.register_parameter("bias", None)

    def takes_fp8_rows(self, rows: int) -> bool:
        """Whether `forward` on `rows` rows takes its input as `Fp8Rows` (quantized
        by the op that made it; `LinearMethod.takes_fp8_rows`)."""
        return self.quant_method.takes_fp8_rows(self, rows)

    def add_weight(self, name: str, data: torch.Tensor, spec: WeightSpec) -> nn.Parameter:
        """Register `data` as parameter `name`, mapped to the checkpoint by `spec`."""
        return register_weight(self, name, data, spec)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        weight_spec(param).load(self, param, loaded, shard_id)

    def output_piece(self, shard_id: ShardId) -> Piece:
        raise NotImplementedError

    def input_piece(self) -> Piece:
        raise NotImplementedError

    def _check_shard(self, shard_id: ShardId) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard {shard_id!r} is not one of {type(self).__name__}'s "
                             f"{list(self.shard_ids)}")


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's output rows split evenly across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_partition_sizes: list[int] | None = None) -> None:
        """`output_partition_sizes`: this rank's rows of each fused part (subclasses)."""
        super().__init__(input_size, output_size, params_dtype, prefix)
        sizes = output_partition_sizes or [divide(output_size, self.tp_size)]
        self.output_partition_sizes = sizes
        self.output_size_per_partition = sum(sizes)
        self.gather_output = gather_output
        self._create_weights(quant_config, input_size, sizes, bias)

    def output_piece(self, shard_id: ShardId) -> Piece:
        self._check_shard(shard_id)
        size = self.output_size_per_partition
        return Piece(self.output_size, self.tp_rank * size, size)

    def input_piece(self) -> Piece:
        return Piece(self.input_size, 0, self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return tp.tensor_model_parallel_all_gather(out, -1) if self.gather_output else out

    def forward_normed(self, x: FoldedNorm) -> torch.Tensor:
        """`forward` of the norm's output that `x` holds unscaled (`layers/norm_fold.py`;
        one rank)."""
        assert self.tp_size == 1
        return self.quant_method.apply_normed(self, x)

    def forward_unsummed(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        """`forward`, or its split-K partial sums where the weight method's kernel
        leaves them to the consumer (`layers/split_sums.py`; no gather)."""
        if self.gather_output or not split_sums.deferred():
            return self.forward(x)
        return self.quant_method.apply_unsummed(self, x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one weight
    (gate_proj and up_proj -> gate_up_proj). Each rank holds its slice of every
    projection, back to back, so the split after the matmul is local.

    `fused_silu_mul`: the layer is a SwiGLU's [gate; up] and its forward returns
    silu(gate) * up, fused into the product where the weight method can
    (`LinearMethod.apply_silu_mul`)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None, *, fused_silu_mul: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        self.output_sizes = list(output_sizes)
        self.shard_ids = tuple(range(len(self.output_sizes)))
        tp_size = tp.get_tp_size()
        if fused_silu_mul and (len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]):
            raise ValueError(f"fused_silu_mul needs two equal output sizes, got {output_sizes}")
        self.fused_silu_mul = fused_silu_mul
        super().__init__(input_size, sum(output_sizes), bias=bias, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix,
                         output_partition_sizes=[divide(s, tp_size) for s in output_sizes])
        self.act_fn = SiluAndMul() if fused_silu_mul else None

    def output_piece(self, shard_id: ShardId) -> Piece:
        self._check_shard(shard_id)
        size = self.output_partition_sizes[shard_id]
        return Piece(self.output_sizes[shard_id], self.tp_rank * size, size,
                     sum(self.output_partition_sizes[:shard_id]))

    def forward(self, x: torch.Tensor | Fp8Rows, fp8_out: bool = False
                ) -> torch.Tensor | Fp8Rows:
        """`fp8_out` (with `fused_silu_mul`): silu(gate) * up quantized per row to
        FP8 for the next projection (`LinearBase.takes_fp8_rows`)."""
        if not self.fused_silu_mul:
            return super().forward(x)
        if self.bias is None:
            out = self.quant_method.apply_silu_mul(self, x)
            if out is not None:
                return to_fp8_rows(out) if fp8_out else out
        return self.act_fn(self.quant_method.apply(self, x, self.bias), fp8_out=fp8_out)

    def forward_normed(self, x: FoldedNorm) -> torch.Tensor:
        if not self.fused_silu_mul:
            return super().forward_normed(x)
        assert self.tp_size == 1
        if self.bias is None:
            return self.quant_method.apply_normed(self, x, silu_mul=True)
        return self.act_fn(self.quant_method.apply_normed(self, x))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused into one matmul, split by attention head as
    `head_partition` says (KV heads replicated when fewer than the ranks)."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False,
                 params_dtype: torch.dtype | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.q_start, self.num_heads, self.kv_start, self.num_kv_heads = head_partition(
            total_num_heads, self.total_num_kv_heads, tp.get_tp_size(), tp.get_tp_rank())
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        total = (total_num_heads + 2 * self.total_num_kv_heads) * head_size
        super().__init__(hidden_size, total, bias=bias, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix,
                         output_partition_sizes=[self.q_size, self.kv_size, self.kv_size])

    def output_piece(self, shard_id: ShardId) -> Piece:
        self._check_shard(shard_id)
        hd = self.head_size
        if shard_id == "q":
            return Piece(self.total_num_heads * hd, self.q_start * hd, self.q_size)
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return Piece(self.total_num_kv_heads * hd, self.kv_start * hd, self.kv_size, offset)


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's input columns split across ranks; partial sums are
    all-reduced, and the bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_is_parallel: bool = True, reduce_results: bool = True,
                 params_dtype: torch.dtype | None = None,
                 input_partition: tuple[int, int] | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        """`input_partition` (start, size): this rank's input columns when they are
        not an even split (attention heads cut unevenly)."""
        super().__init__(input_size, output_size, params_dtype, prefix)
        if input_partition is None:
            size = divide(input_size, self.tp_size)
            input_partition = (self.tp_rank * size, size)
        self.input_start, self.input_size_per_partition = input_partition
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self._create_weights(quant_config, self.input_size_per_partition, [output_size], bias)

    def output_piece(self, shard_id: ShardId) -> Piece:
        self._check_shard(shard_id)
        return Piece(self.output_size, 0, self.output_size)

    def input_piece(self) -> Piece:
        return Piece(self.input_size, self.input_start, self.input_size_per_partition)

    def takes_fp8_rows(self, rows: int) -> bool:
        return self.input_is_parallel and super().takes_fp8_rows(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        method = self.quant_method
        if self.tp_size == 1:
            return method.apply(self, x, self.bias)
        if not self.input_is_parallel:
            x = x.narrow(-1, self.input_start, self.input_size_per_partition)
        if self.reduce_results:
            out = tp.tensor_model_parallel_all_reduce(method.apply(self, x))
            return out if self.bias is None else out + self.bias
        # The consumer sums the partials (maybe fused with its norm, from the buffer
        # every rank writes in the same order): only rank 0 adds the bias, in place.
        buf = tp.partial_sum_buffer((*x.shape[:-1], self.output_size), x.dtype, x.device)
        return method.apply(self, x, self.bias if self.tp_rank == 0 else None, out=buf)

    def forward_into_norm(self, x: torch.Tensor, target: NormTarget) -> FoldedNorm:
        """`forward` added to `target`'s residual and held as its norm's input
        (`layers/norm_fold.py`; one rank)."""
        assert self.tp_size == 1
        return self.quant_method.apply_into_norm(self, x, target)
