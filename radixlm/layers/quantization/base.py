"""The seam between a linear layer and the way its weight is stored and multiplied.

A parallel linear layer (`layers/linear.py`, and the LM head) knows its shape
and its tensor-parallel partition; a `LinearMethod` knows everything about
its weight: which parameters hold it, how a checkpoint tensor lands in them,
what is derived from them after loading, how y = x W^T + b is computed, and
how the checkpoint tensor is read back. A `QuantizationConfig`, built once per
model, picks the method of every layer. Unquantized weights run through
`unquantized.py` (plain F.linear, oneDNN-prepacked on the CPU, Triton GEMV on
CUDA); a quantized format (FP8, int4, GGUF, int8) is one more config and
method here, with no edit to the layers, the loader or the weight updater.

Contract for a method (one instance per layer, so it may keep per-layer
decisions; per-layer tensors live on the layer). A method may read from the
layer: `input_size` / `output_size` (whole, all ranks), `params_dtype`,
`tp_rank` / `tp_size`, `prefix`, `shard_ids` and `output_piece(shard_id)` /
`input_piece()` (its partition, `layers/sharding.py`), `bias`, and on a
merged gate/up layer `fused_silu_mul`. The LM head (`ParallelLMHead`) gets
a method too, for its product only: its weight is the embedding table
(the input embedding itself when tied), so its method's `create_weights` is
never called and `apply` reads `layer.weight` as it is (and what the table's
parameter spec says about its layout).

An embedding table (`VocabParallelEmbedding`, and an untied LM head's table)
is created and looked up by an `EmbeddingMethod` from
`QuantizationConfig.get_embedding_method`: float rows by default, or a
quantized table whose lookups dequantize rows (GGUF). The head's linear
method and the table's embedding method then agree on the layout.

1. `create_weights(layer, ...)` runs in the layer's constructor, under the
   model's dtype and device as torch's defaults (`torch.empty` lands there).
   It registers every parameter the method needs (`weight`, and for a
   quantized format its scales, zero points, ...) with
   `layer.add_weight(name, tensor, spec)`. The method owns those parameters;
   the layer owns its partition and its bias ([out_local] in params_dtype,
   which the layer passes to `apply`).
2. Loading. The loader resolves each checkpoint name to (layer, parameter,
   shard id) and calls `param.weight_loader(param, tensor, shard_id)`, which
   hands the parameter's spec (`layers/sharding.py`) the **whole checkpoint
   tensor**: all ranks' parts, in the checkpoint's layout and dtype, on any
   device; for a fused layer one part of it (`shard_id` "q"/"k"/"v" of
   qkv_proj, 0/1 of gate_up_proj) or the fused tensor whole (None). The spec
   cuts this rank's piece from the layer's `output_piece`/`input_piece` and
   writes it in place. Always whole tensors, never pre-cut shards: the same
   path serves start-up, every weight update and every tensor-parallel size.
   A parameter stored as the checkpoint stores it but not as floats (packed
   int4, GGUF blocks, fp8) says so in its `AxisSpec` (`input_packing`,
   `checkpoint_dtypes`: anything else is refused at load), or brings its own
   `WeightSpec` subclass (a per-tensor scale per fused part); the spec also answers the
   whole tensor's shape (checked before any write), the shard ids a complete
   checkpoint provides, and gathers the whole tensor back from every rank
   (`get_weights_by_name`). Read-back gives the checkpoint's layout and
   dtype: what the parameters hold, so keep them in checkpoint form, or give
   the spec the conversion both ways (int4's AWQ repacking and its
   tensor-core fragment order: `int4.AwqQweightSpec`, `int4.FragmentSpec`).
3. `process_weights_after_loading(layer)` runs once every parameter of the
   model is written: after the initial load, after **every** in-place update
   (and after an update's rollback), and after the weights come back from a
   memory release. It derives what `apply` reads (a prepacked copy, a
   transposed view, a dequantized fp32 copy, a kernel's reordered layout) and
   stores it as plain layer attributes. It must replace what an earlier call
   derived, not add to it (it runs many times), and must not replace,
   reshape or re-type a parameter: updates write checkpoint tensors into the
   parameters again, and read-back reads them. `drop_derived(layer)` forgets
   the derived state (the weights are about to be released).
4. `apply(layer, x, bias, out)` computes x W^T + bias: x is [..., in_local]
   in the layer's params_dtype on its device (maybe non-contiguous), bias is
   [out_local] or None; returns [..., out_local] in x's dtype. `out`, when
   given, is a contiguous CUDA tensor of that shape and dtype that the
   result must be written into (a row-parallel layer writing its partial sum
   straight into the fused all-reduce's buffer): write it and return it.
   `apply_silu_mul(layer, x)` optionally fuses a merged [gate; up] product
   with silu(gate) * up; None means the caller runs `apply` and the
   activation itself. Neither may synchronize with the host (CUDA graphs
   capture them).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from radixlm.layers.norm_fold import FoldedNorm, NormTarget, fold_into
from radixlm.layers.split_sums import SplitSums

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from radixlm.layers.linear import LinearBase
    from radixlm.layers.moe.fused_moe import FusedMoE


class LinearMethod(ABC):
    """How one linear layer holds and applies its weight (see the module docstring).

    `batch_invariant`: a row's product is the same bits however many rows are
    multiplied with it (what --enable-deterministic-inference requires of
    every layer's method)."""

    batch_invariant = False
    # Its products run on our CPU kernels' worker pool (`cpu_ops/qgemm_pool.h`),
    # not on torch's threads: a model whose weights are mostly such layers runs
    # its decode steps' other ops on one thread (`ModelRunner.cpu_threads`).
    on_product_pool = False

    @abstractmethod
    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype) -> None:
        """Register the method's parameters on `layer` (`layer.add_weight`).
        `output_partition_sizes`: this rank's rows of each fused part, in
        order (one entry for an unfused layer); `params_dtype`: the model's
        dtype, that of the activations."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + bias (into `out` when given)."""

    def takes_fp8_rows(self, layer: LinearBase, rows: int) -> bool:
        """Whether `apply` on `rows` rows would first quantize them per token to FP8
        (one fp32 scale a row): then the op that makes the input may hand it over
        quantized, as `Fp8Rows` (`fp8_rows.py`), which `apply` (and
        `apply_silu_mul`, which may return None for it) must then take."""
        return False

    def apply_silu_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x G^T) * (x U^T) for the merged weight [G; U] of a bias-free
        layer, or None when this method has no fused path for `x`."""
        return None

    def apply_unsummed(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | SplitSums:
        """`apply` with the layer's bias, or, where this method's kernel would add its
        split-K partial sums in a launch of their own, those sums left to the
        consumer (`layers/split_sums.py`). The default leaves nothing."""
        return self.apply(layer, x, layer.bias)

    # A residual RMSNorm folded into the products around it (`layers/norm_fold.py`).
    # The defaults compute it with torch around `apply`, so any method gives the
    # folded forward its numbers; a method whose kernels do it says up to how many
    # rows in `norm_fold_rows`.
    def norm_fold_rows(self, layer: LinearBase, output: bool) -> int:
        """The most rows at which this method's kernels take a folded norm as the
        input of `layer`'s product (`apply_normed`), or with `output` give one as
        its output (`apply_into_norm`), at no launch of their own: 0, none."""
        return 0

    def apply_normed(self, layer: LinearBase, x: FoldedNorm, silu_mul: bool = False
                     ) -> torch.Tensor:
        """`apply` (or `apply_silu_mul` where `silu_mul`, bias-free) on the norm's
        output that `x` holds unscaled."""
        _warn_torch_fold(layer, x.x)
        rows = x.normalized()
        if silu_mul:
            out = self.apply_silu_mul(layer, rows)
            if out is not None:
                return out
            return layer.act_fn(self.apply(layer, rows))  # the layer's SiluAndMul
        return self.apply(layer, rows, layer.bias)

    def apply_into_norm(self, layer: LinearBase, x: torch.Tensor,
                        target: NormTarget) -> FoldedNorm:
        """`apply` (with the layer's bias), added to `target`'s residual and held
        as the input of `target`'s norm."""
        _warn_torch_fold(layer, x)
        return fold_into(self.apply(layer, x, layer.bias), target)

    def process_weights_after_loading(self, layer: LinearBase) -> None:  # noqa: B027 (optional)
        """Derive from the freshly written parameters what `apply` reads (by
        default nothing: `apply` reads the parameters)."""

    def drop_derived(self, layer: LinearBase) -> None:  # noqa: B027 (optional)
        """Forget what `process_weights_after_loading` derived."""


def _warn_torch_fold(layer: LinearBase, x: torch.Tensor) -> None:
    """On CUDA the decoder folds only where the kernels say they take the fold, so
    the torch defaults running there mean a layer's kernels turned these rows
    down: several launches where the norm was one. Said once per method."""
    method = type(layer.quant_method).__name__
    if x.is_cuda and method not in _WARNED:
        _WARNED.add(method)
        logger.warning("%s: a folded norm around %s (x %s) runs in torch, not in the kernels",
                       method, layer.prefix, tuple(x.shape))


_WARNED: set[str] = set()


class FusedMoEMethod(ABC):
    """How one MoE layer's experts are held and computed: the same rules as a
    linear method (parameters registered with `layer.add_weight`, derived
    state in `process_weights_after_loading`, no host sync in `apply`). The
    layer (`layers/moe/fused_moe.py`) owns the partition of each stacked
    weight (`layer.partition("gate_up_proj")`, `layer.partition("down_proj")`:
    which experts, which intermediate slice); the parameters are
    `gate_up_proj` [local experts, 2 x local intermediate, hidden] (gate rows,
    then up rows) and `down_proj` [local experts, hidden, local intermediate],
    or a format's stacks of the same tensors, with `ExpertSpec`s
    (`layers/sharding.py`)."""

    # No expert kernel yet gives a row the same bits at every batch size (the
    # grouping by expert changes with the batch): --enable-deterministic-inference
    # refuses these layers.
    batch_invariant = False
    on_product_pool = False  # as LinearMethod's

    @abstractmethod
    def create_weights(self, layer: FusedMoE, params_dtype: torch.dtype) -> None:
        """Register the stacked expert parameters on `layer`."""

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) over this rank's
        experts: x [T, hidden]; topk_weights [T, k] float32; topk_ids [T, k] int32
        local expert ids, -1 for another rank's. Returns [T, hidden] in x's
        dtype: this rank's partial sum."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:  # noqa: B027 (optional)
        """Derive what `apply` reads from the freshly written parameters."""

    def drop_derived(self, layer: FusedMoE) -> None:  # noqa: B027 (optional)
        """Forget what `process_weights_after_loading` derived."""

    def describe(self, layer: FusedMoE) -> str:
        """How the experts are computed, for the start-up log."""
        return type(self).__name__


class EmbeddingMethod(ABC):
    """How an embedding table is held and looked up. Same rules as a linear
    method: parameters registered with `layer.add_weight` in `create_weights`
    (a table of [rows of this rank (padded), embedding_dim]), derived state in
    `process_weights_after_loading`."""

    batch_invariant = True  # a lookup reads each token's own row

    @abstractmethod
    def create_weights(self, layer: Any, embedding_dim: int, num_rows: int,
                       params_dtype: torch.dtype) -> None:
        """Register the table's parameters (rows past the vocabulary read as zeros)."""

    @abstractmethod
    def embedding(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (of this rank's table) in `layer.params_dtype`, [*ids.shape, dim]."""

    def process_weights_after_loading(self, layer: Any) -> None:  # noqa: B027 (optional)
        """Derive what `embedding` reads from the freshly written parameters."""

    def drop_derived(self, layer: Any) -> None:  # noqa: B027 (optional)
        """Forget what `process_weights_after_loading` derived."""


class QuantizationConfig(ABC):
    """Picks the linear method of every layer of one model. Built once, from
    the server arguments and the checkpoint's config.json, before the model;
    the model passes it to each layer with the layer's dotted name."""

    # The --quantization name, and the quantization_config "quant_method" of
    # checkpoints in this format (None: the unquantized default).
    name: ClassVar[str | None] = None
    # The config of the layers this format leaves float (the LM head among them),
    # set by formats that have such layers.
    fallback: QuantizationConfig | None = None

    @classmethod
    def from_hf_config(cls, hf_quant_config: dict[str, Any], **options: Any
                       ) -> QuantizationConfig:
        """Built from a checkpoint's `quantization_config`; refuse (ValueError,
        naming the field) any setting the method cannot honour."""
        raise NotImplementedError(f"{cls.__name__} is not read from a quantization_config")

    @abstractmethod
    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod:
        """The method for `layer`, our module named `prefix` (e.g.
        'model.layers.0.self_attn.qkv_proj', 'lm_head'): a fresh instance per
        layer. Layers a format leaves unquantized (often the LM head) get an
        unquantized method."""

    def get_embedding_method(self, layer: Any, prefix: str) -> EmbeddingMethod:
        """The method of an embedding table ('model.embed_tokens', or 'lm_head'
        for an untied head's table); default: the fallback's, else float rows."""
        if self.fallback is not None:
            return self.fallback.get_embedding_method(layer, prefix)
        from radixlm.layers.quantization.unquantized import UnquantizedEmbeddingMethod

        return UnquantizedEmbeddingMethod()

    def get_moe_method(self, layer: FusedMoE, prefix: str) -> FusedMoEMethod:
        """The method of MoE layer `prefix`'s experts ('model.layers.3.mlp.experts').
        A format without expert kernels refuses: its checkpoint's expert tensors
        are not float, and quantizing only the dense layers of a float
        checkpoint would not be what `--quantization` asked for."""
        raise ValueError(f"quantization {self.name!r}: the mixture-of-experts layer {prefix} "
                         f"has no {self.name} expert kernels; serve the model unquantized, "
                         "in FP8 or as GGUF")

    def checkpoint_weights(self, model_dir: str) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The checkpoint's (name, whole tensor) pairs for a format whose tensors
        do not come from the directory's *.safetensors as they are (GGUF blocks,
        packed from the .gguf file and cached); None: they do. Called once the
        model is built, so it may depend on what the layers chose."""
        return None

    def dummy_weights(self, weights: Iterator[tuple[str, torch.Tensor]], model: Any
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """`--load-format dummy`: the checkpoint tensors to load for the random float
        tensors `weights` (HF names, as a float checkpoint has them), once the model
        is built. Default: those tensors (a method that quantizes floats at load
        takes them as they are); a format whose checkpoint holds other tensors
        (packed int4) makes random ones of those."""
        return weights

    def describe(self) -> str | None:
        """One line for the start-up log: what the layers chose and why (None: nothing to say)."""
        return None
