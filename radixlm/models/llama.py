"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5.

Pre-norm decoder: RMSNorm -> attention (GQA, RoPE) -> RMSNorm -> SwiGLU MLP,
with the residual add fused into the next norm. q/k/v and gate/up run as one
fused matmul each; `weight_mapping` tells the loader (`models/weight_map.py`)
how HF checkpoint names map onto them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixlm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixlm.layers.norm import RMSNorm
from radixlm.layers.quantization import QuantizationConfig
from radixlm.layers.rotary import RotaryEmbedding, get_rope
from radixlm.layers.sharding import ShardId
from radixlm.models.weight_map import WeightMapping, load_weights

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

WEIGHT_MAPPING = WeightMapping(
    # HF projection name -> (our fused module's name, shard id inside it).
    fused={
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    },
    # Buffers some checkpoints carry that we recompute.
    skipped=("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached"),
)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        # Returns silu(gate) * up, fused with the product where the weight method can.
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, fused_silu_mul=True,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        # Partial sums under tensor parallelism: the next norm all-reduces them.
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           reduce_results=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary_emb: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        qkv = self.qkv_proj
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias,
                                        input_partition=(qkv.q_start * head_dim, qkv.q_size),
                                        reduce_results=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        self.split_sizes = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                                   head_dim, scaling=head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows`: project only these rows of the attention output (every token's
        K/V is still computed and stored)."""
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        out = self.attn(q, k, v, fb, rope=(self.rotary_emb, positions))
        return self.o_proj(out if rows is None else out[rows])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, rotary_emb: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_id, rotary_emb, qkv_bias, o_bias,
                                        quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            bias=getattr(config, "mlp_bias", False), quant_config=quant_config,
                            prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, fb: ForwardBatch,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows`: return only these token rows (the last layer in prefill, where
        only the rows that get logits go on). Under tensor parallelism `hidden`
        (in and out, after the first layer) is the rank's partial sum of the
        previous MLP: the norms all-reduce, fused with their add where they can."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, reduce=True)
        hidden = self.self_attn(positions, hidden, fb, rows)
        if rows is not None:
            residual = residual[rows]
        hidden, residual = self.post_attention_layernorm(hidden, residual, reduce=True)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        # One cos/sin table shared by every layer (it is large for 128k contexts).
        rotary_emb = get_rope(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, qkv_bias, o_bias, quant_config,
                              prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                last_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (last layer's output, residual stream): the final norm (with
        reduce=True: the output is a per-rank partial sum under tensor
        parallelism) is left to the caller. With `last_rows`
        the last layer runs its output projection and MLP on those rows only,
        and only they are returned."""
        hidden, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, fb,
                                     last_rows if i == last else None)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    # Qwen2 has q/k/v biases whatever the config says.
    always_qkv_bias = False
    weight_mapping: ClassVar[WeightMapping] = WEIGHT_MAPPING

    def __init__(self, config: PretrainedConfig,
                 quant_config: QuantizationConfig | None = None) -> None:
        """`quant_config`: picks each linear layer's weight method (default:
        unquantized, with the fast paths of the device and dtype)."""
        super().__init__()
        _check_config(config)
        self.config = config
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(config, qkv_bias=attention_bias or self.always_qkv_bias,
                                o_bias=attention_bias, quant_config=quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tied_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tied_to=tied_to,
                                      quant_config=quant_config, prefix="lm_head")
        attn = self.model.layers[0].self_attn.attn
        # What a KV pool for this rank needs.
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """float32 logits [len(fb.logit_rows), vocab] for the rows `fb.logit_rows`
        of the flat token axis (default: each request's last new token)."""
        rows = fb.logit_rows
        if rows is None:
            rows = fb.extend_start_loc + fb.extend_seq_lens - 1
        # Prefill: the last layer's o_proj and MLP only for the logit rows (~3%).
        every_row = fb.mode.is_decode() or rows.numel() == fb.num_tokens
        hidden, residual = self.model(input_ids, positions, fb,
                                      last_rows=None if every_row else rows)
        # Normed before picking rows: the norm all-reduces the MLP's partial sums
        # in place (in the buffer the MLP wrote), which a gathered copy is not.
        hidden = self.model.norm(hidden, residual, reduce=True)[0]
        if every_row:
            hidden = hidden[rows]
        return self.lm_head.compute_logits(hidden).float()

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       fb: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [num_tokens, hidden] of every token."""
        hidden, residual = self.model(input_ids, positions, fb)
        return self.model.norm(hidden, residual, reduce=True)[0]

    # ---- weights ---------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> dict[str, set[ShardId]]:
        """Copy HF-named tensors into place (`models/weight_map.py`); returns, per
        parameter written (our name), the shard ids written, so a caller loading
        a full checkpoint can check nothing is missing (a partial update may
        legitimately write fewer). ValueError for a tensor with no place here."""
        return load_weights(self, weights)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    always_qkv_bias = True


def _check_config(config: PretrainedConfig) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported by the Llama family (only 'silu')")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and \
            window < config.max_position_embeddings:
        logger.warning("sliding-window attention (window %d) is not implemented: attention is "
                       "over the full context, exact only up to %d tokens", window, window)
