"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the (padded) vocabulary;
rows past the real vocabulary are zero padding, so `per_rank` is the same on
every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm import distributed as tp
from radixlm.layers.quantization import QuantizationConfig, UnquantizedConfig
from radixlm.layers.sharding import AxisSpec, Piece, ShardId, weight_spec


class VocabParallelEmbedding(nn.Module):
    shard_ids: tuple[ShardId, ...] = (None,)

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None,
                 weight: nn.Parameter | None = None) -> None:
        """`weight`: share an existing parameter (tied embeddings) instead of allocating one."""
        super().__init__()
        self.tp_rank, self.tp_size = tp.get_tp_rank(), tp.get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        if weight is None:
            # Zeros, not empty: the padding rows past the vocabulary are never loaded.
            weight = nn.Parameter(
                torch.zeros(self.num_embeddings_per_partition, embedding_dim,
                            dtype=self.params_dtype), requires_grad=False)
            weight.weight_spec = AxisSpec(output_dim=0, input_dim=1)
            weight.weight_loader = self.weight_loader
        self.weight = weight

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
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"checkpoint vocabulary has {loaded.shape[0]} rows, "
                             f"the config says vocab_size={self.num_embeddings}")
        weight_spec(param).load(self, param, loaded, shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce
        # then leaves each token the one rank's row that owns it.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tp.tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary (gathered from all ranks).

    The weight is an embedding table ([vocab rows of this rank, hidden], the
    input embedding itself when tied); the product runs through a linear
    method like any linear layer's, which creates no parameters here: its
    `apply` reads `layer.weight` as it is, and what it needs beyond that it
    derives in `process_weights_after_loading`."""

    bias = None

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None,
                 tied_to: VocabParallelEmbedding | None = None, *,
                 quant_config: QuantizationConfig | None = None, prefix: str = "lm_head") -> None:
        """`tied_to`: reuse that input embedding's weight (tie_word_embeddings)."""
        weight = tied_to.weight if tied_to is not None else None
        super().__init__(num_embeddings, embedding_dim, params_dtype, weight=weight)
        self.input_size, self.output_size = embedding_dim, num_embeddings  # as a linear layer's
        self.prefix = prefix
        self.quant_method = (quant_config or UnquantizedConfig()).get_linear_method(
            self, prefix)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden)
        logits = tp.tensor_model_parallel_all_gather(logits, -1)
        return logits[..., :self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
