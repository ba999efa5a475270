"""OLMoE (OLMoE-1B-7B): a Llama-style decoder whose q and k are RMS-normed over
the whole projection (all heads at once, before the rotary embedding), then
clamped to +-`clip_qkv` with v when set, and whose every MLP is a mixture of
`num_experts` experts (64, top-8) of `intermediate_size`, top-k weights
renormalized when `norm_topk_prob`.

Under tensor parallelism each rank holds some heads, so the norm's mean
square is a sum over the ranks (one all-reduce of a column per token), and
its weight is split with the heads."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm import distributed as tp
from radixlm.layers import cpu_ops
from radixlm.layers.rotary import RotaryEmbedding
from radixlm.layers.sharding import AxisSpec, Piece, ShardId, register_weight, weight_spec
from radixlm.models import hf_config
from radixlm.models.decoder import (
    HF_MOE_PROJECTIONS,
    DecoderAttention,
    DecoderForCausalLM,
    DecoderSpec,
    MoeSpec,
    head_dim_of,
    num_experts,
    sparse_layers,
)
from radixlm.models.weight_map import WeightMapping

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch
    from radixlm.layers.quantization import QuantizationConfig


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection whose heads are split over the
    ranks: this rank holds features [start, start + size) of `total`, each
    held by `replicas` ranks (KV heads replicated when fewer than the ranks)."""

    shard_ids = (None,)

    def __init__(self, total: int, start: int, size: int, eps: float,
                 replicas: int = 1) -> None:
        super().__init__()
        self.total, self.start, self.size = total, start, size
        self.eps = eps
        self.replicas = replicas
        register_weight(self, "weight", torch.ones(size),
                        AxisSpec(output_dim=0, input_dim=None))

    def output_piece(self, shard_id: ShardId) -> Piece:
        return Piece(self.total, self.start, self.size)

    def input_piece(self) -> Piece:
        return Piece(1, 0, 1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        weight_spec(param).load(self, param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == self.total and cpu_ops.use_fused(x, self.weight):
            return cpu_ops.rms_norm(x, self.weight, self.eps)  # one kernel for ~8 ops
        xf = x.float()
        if self.size == self.total:
            mean_square = xf.pow(2).mean(-1, keepdim=True)
        else:
            squares = xf.pow(2).sum(-1, keepdim=True)
            if self.replicas > 1:
                squares = squares / self.replicas
            mean_square = tp.tensor_model_parallel_all_reduce(squares) / self.total
        return self.weight * (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class OlmoeAttention(DecoderAttention):
    """Attention with q and k normed over the whole projection, and `clip_qkv`."""

    def __init__(self, spec: DecoderSpec, layer_id: int, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(spec, layer_id, rotary_emb, quant_config, prefix)
        qkv, d, eps = self.qkv_proj, spec.head_dim, spec.rms_norm_eps
        kv_replicas = max(1, tp.get_tp_size() // spec.num_kv_heads)
        self.q_norm = ProjectionRMSNorm(spec.num_heads * d, qkv.q_start * d, qkv.q_size, eps)
        self.k_norm = ProjectionRMSNorm(spec.num_kv_heads * d, qkv.kv_start * d, qkv.kv_size,
                                        eps, kv_replicas)
        self.rope = rotary_emb
        self.clip = spec.config.clip_qkv

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        out = self.attn(q, k, v, fb, rope=(self.rope, positions))
        return self.o_proj(out if rows is None else out[rows])


class OlmoeForCausalLM(DecoderForCausalLM):
    weight_mapping: ClassVar[WeightMapping] = HF_MOE_PROJECTIONS

    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        clip = getattr(config, "clip_qkv", None)
        if clip is not None and not (isinstance(clip, int | float) and clip > 0):
            raise hf_config.refuse("clip_qkv", clip, "expected a positive number or null")
        if head_dim_of(config) * config.num_attention_heads != config.hidden_size:
            raise hf_config.refuse("head_dim", head_dim_of(config), "OLMoE's norms span "
                                   "hidden_size: heads x head_dim must equal it")
        bias = hf_config.flag(config, "attention_bias")
        layers = config.num_hidden_layers
        moe = MoeSpec(num_experts=num_experts(config), top_k=config.num_experts_per_tok,
                      intermediate_size=config.intermediate_size,
                      renormalize=hf_config.flag(config, "norm_topk_prob"), round_weights=True)
        return DecoderSpec.from_hf(config, qkv_bias=bias, o_bias=bias,
                                   activation=hf_config.activation(config, ("silu",)),
                                   attention_layers=(OlmoeAttention,) * layers,
                                   mlp_layers=sparse_layers(layers), moe=moe)
