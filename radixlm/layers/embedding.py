"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the (padded) vocabulary;
rows past the real vocabulary are zero padding, so `per_rank` is the same on
every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm import distributed as tp
from radixlm.layers.quantization import QuantizationConfig, UnquantizedConfig
from radixlm.layers.sharding import Piece, ShardId, WeightSpec, register_weight, weight_spec


class VocabParallelEmbedding(nn.Module):
    """The table's parameters and lookups come from its `EmbeddingMethod`
    (`QuantizationConfig.get_embedding_method`): float rows, or a quantized
    table (GGUF) whose lookups dequantize the rows they read."""

    shard_ids: tuple[ShardId, ...] = (None,)

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None,
                 weight: nn.Parameter | None = None, *,
                 quant_config: QuantizationConfig | None = None,
                 prefix: str = "model.embed_tokens") -> None:
        """`weight`: share an existing parameter (tied embeddings) instead of allocating one."""
        super().__init__()
        self.tp_rank, self.tp_size = tp.get_tp_rank(), tp.get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.prefix = prefix
        if weight is None:
            self.quant_method = (quant_config or UnquantizedConfig()).get_embedding_method(
                self, prefix)
            self.quant_method.create_weights(self, embedding_dim,
                                             self.num_embeddings_per_partition, self.params_dtype)
        else:
            self.weight = weight

    def add_weight(self, name: str, data: torch.Tensor, spec: WeightSpec) -> nn.Parameter:
        """Register `data` as parameter `name`, mapped to the checkpoint by `spec`."""
        return register_weight(self, name, data, spec)

    def output_piece(self, shard_id: ShardId) -> Piece:
        """The vocabulary rows of this rank (the padding rows after them are not loaded)."""
        if shard_id is not None:
            raise ValueError(f"shard {shard_id!r} given for an embedding, which has none")
        return Piece(self.num_embeddings, self.vocab_start,
                     max(0, self.vocab_end - self.vocab_start))

    def input_piece(self) -> Piece:
        return Piece(self.embedding_dim, 0, self.embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        # A float table's rows are the vocabulary (a packed one's spec checks its bytes).
        if loaded.is_floating_point() and loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"checkpoint vocabulary has {loaded.shape[0]} rows, "
                             f"the config says vocab_size={self.num_embeddings}")
        weight_spec(param).load(self, param, loaded, shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_ids)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce
        # then leaves each token the one rank's row that owns it.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = self.quant_method.embedding(self, local)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tp.tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary (gathered from all ranks).

    The weight is an embedding table ([vocab rows of this rank, hidden], the
    input embedding itself when tied, else made by the table's embedding
    method under `prefix`); the product runs through a linear method like any
    linear layer's, which creates no parameters here: its `apply` reads
    `layer.weight` as it is, and what it needs beyond that it derives in
    `process_weights_after_loading`."""

    bias = None

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None,
                 tied_to: VocabParallelEmbedding | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "lm_head") -> None:
        """`tied_to`: reuse that input embedding's weight (tie_word_embeddings)."""
        weight = tied_to.weight if tied_to is not None else None
        super().__init__(num_embeddings, embedding_dim, params_dtype, weight=weight,
                         quant_config=quant_config, prefix=prefix)
        self.input_size, self.output_size = embedding_dim, num_embeddings  # as a linear layer's
        self.quant_method = (quant_config or UnquantizedConfig()).get_linear_method(
            self, prefix)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden)
        logits = tp.tensor_model_parallel_all_gather(logits, -1)
        return logits[..., :self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
