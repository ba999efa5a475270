"""The decoder-only transformer every dense family is built from.

Pre-norm layers: norm -> attention (GQA, RoPE; optional QK-norm, sliding
window, logit softcap) -> norm -> gated MLP, with the residual add fused into
the next norm. Gemma's "sandwich" layers also normalize each block's output
before its residual add (post-attention, pre- and post-feed-forward norms).
q/k/v and gate/up run as one fused matmul each.

A family is a subclass of `DecoderForCausalLM` that says what its config
means in a `DecoderSpec` (`decoder_spec`, refusing what it cannot honour) and
how its checkpoint names map onto our modules (`weight_mapping`, read by
`models/weight_map.py`). Module names are HF's, so that mapping is only about
the fused projections and the stacked experts.

Each layer's attention and MLP come from per-layer factories in the spec
(`attention_layers`, `mlp_layers`): the dense gated MLP by default, a
mixture of experts (`moe_mlp`), or one with a shared expert
(`moe_shared_mlp`, Qwen2-MoE); `sparse_layers` lays them out as a family's
config says (Qwen's `decoder_sparse_step` / `mlp_only_layers`, and a leading
run of dense layers as DeepSeek's `first_k_dense_replace`).

Tensor parallelism: the row-parallel projections (o_proj, down_proj) leave
per-rank partial sums (`reduce_results=False`); the norm that consumes one
all-reduces it (`reduce=True`), fused with its residual add where it can.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm import distributed as tp
from radixlm.cache.kv_spec import MHA, KVSpec
from radixlm.layers.activation import GATED_ACTIVATIONS
from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixlm.layers.fp8_rows import Fp8Rows
from radixlm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixlm.layers.moe.block import SparseMoeBlock
from radixlm.layers.moe.fused_moe import FusedMoE
from radixlm.layers.moe.router import SharedExpertGate, TopKRouter
from radixlm.layers.norm import RMSNorm
from radixlm.layers.norm_fold import FoldedNorm, NormTarget
from radixlm.layers.quantization import QuantizationConfig
from radixlm.layers.rotary import QKNormRotary, RotaryEmbedding, get_rope
from radixlm.layers.sharding import ShardId
from radixlm.layers.split_sums import SplitSums
from radixlm.models.weight_map import WeightMapping, load_weights

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# HF's separate projections -> our fused modules (shard id inside each). A
# checkpoint that already fuses them (Phi-3's qkv_proj, gate_up_proj) uses our
# names and loads whole.
HF_PROJECTIONS = WeightMapping(
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


# HF's per-expert projections -> our stacked expert weights (part inside each expert):
# Qwen's and OLMoE's names, and Mixtral's w1 (gate), w3 (up), w2 (down).
HF_EXPERTS = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
}
HF_MOE_PROJECTIONS = WeightMapping(fused=HF_PROJECTIONS.fused, skipped=HF_PROJECTIONS.skipped,
                                   experts=HF_EXPERTS)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class MoeSpec:
    """The routed experts of a family's MoE layers (`moe_mlp`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights are rescaled to sum to one
    round_weights: bool = False  # routing weights rounded to the model's dtype (HF Qwen, OLMoE)
    shared_expert_intermediate_size: int = 0  # `moe_shared_mlp`'s shared expert
    shared_expert_gate: bool = False  # the shared expert scaled by sigmoid(x w^T)


def num_experts(config: PretrainedConfig) -> int:
    """The config's expert count: transformers keeps Qwen's and OLMoE's
    `num_experts` as `num_local_experts` (Mixtral's name), which is what a plain
    config read back from its config.json has."""
    count = getattr(config, "num_experts", None)
    return count if count is not None else getattr(config, "num_local_experts", 0) or 0


# One layer's part, built by the decoder layer: (spec, layer id, quant config, prefix)
# for an MLP, and with the layer's rotary embedding for an attention block.
MlpFactory = Callable[["DecoderSpec", int, "QuantizationConfig | None", str], nn.Module]
AttentionFactory = Callable[..., nn.Module]


@dataclass(frozen=True)
class DecoderSpec:
    """What a family's decoder is made of (`from_hf` reads the shared fields;
    a family passes what differs). Per-layer tuples have one entry per layer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"  # a key of GATED_ACTIVATIONS
    norm: type[RMSNorm] = RMSNorm  # every norm of the model, QK-norms included
    qk_norm: bool = False  # per-head norms of q and k before the rotary embedding
    sandwich_norms: bool = False  # Gemma: each block's output normed before its residual add
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    embed_scale: float | None = None  # token embeddings are multiplied by it
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # None: full attention
    rope_layer_types: tuple[str | None, ...] = ()  # key of per-layer-type rope parameters
    attention_layers: tuple[AttentionFactory, ...] = ()  # per layer; (): DecoderAttention
    mlp_layers: tuple[MlpFactory, ...] = ()  # per layer; (): dense_mlp everywhere
    moe: MoeSpec | None = None  # the experts of the layers whose factory builds them
    # The HF config, for the rotary embeddings (not compared).
    config: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(cls, config: PretrainedConfig, **kw: Any) -> DecoderSpec:
        heads = config.num_attention_heads
        fields = dict(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim_of(config), rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            config=config)
        spec = cls(**{**fields, **kw})
        if spec.activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation {spec.activation!r} (hidden_act) is not supported "
                             f"(supported: {', '.join(GATED_ACTIVATIONS)})")
        for name in ("sliding_windows", "rope_layer_types", "attention_layers", "mlp_layers"):
            if getattr(spec, name) and len(getattr(spec, name)) != spec.num_layers:
                raise ValueError(f"{name}: {len(getattr(spec, name))} entries for "
                                 f"{spec.num_layers} layers")
        if spec.moe is None and any(f in MOE_FACTORIES for f in spec.mlp_layers):
            raise ValueError("MoE layers need the spec's moe (MoeSpec)")
        return spec

    def window(self, layer_id: int) -> int | None:
        return self.sliding_windows[layer_id] if self.sliding_windows else None

    def rope_layer_type(self, layer_id: int) -> str | None:
        return self.rope_layer_types[layer_id] if self.rope_layer_types else None

    def attention_factory(self, layer_id: int) -> AttentionFactory:
        return self.attention_layers[layer_id] if self.attention_layers else DecoderAttention

    def mlp_factory(self, layer_id: int) -> MlpFactory:
        return self.mlp_layers[layer_id] if self.mlp_layers else dense_mlp


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); SiLU fused with the gate/up product where the
    weight method can."""

    def __init__(self, spec: DecoderSpec, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", intermediate_size: int | None = None) -> None:
        """`intermediate_size`: instead of the spec's (a MoE layer's shared expert)."""
        super().__init__()
        silu = spec.activation == "silu"
        inter = intermediate_size or spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [inter] * 2, bias=spec.mlp_bias,
            fused_silu_mul=silu, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.act_fn = None if silu else GATED_ACTIVATIONS[spec.activation]()
        # Partial sums under tensor parallelism: the next norm all-reduces them.
        self.down_proj = RowParallelLinear(inter, spec.hidden_size,
                                           bias=spec.mlp_bias, reduce_results=False,
                                           quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def takes_fp8_input(self, rows: int) -> bool:
        """Whether `forward` takes `rows` rows as `Fp8Rows` (its first projection's)."""
        return self.gate_up_proj.takes_fp8_rows(rows)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if self.act_fn is None:  # SiLU in gate_up, quantized for down where down takes it
            fp8 = self.down_proj.takes_fp8_rows(x.shape[0])
            return self.down_proj(self.gate_up_proj(x, fp8_out=fp8))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_folded(self, x: FoldedNorm, target: NormTarget | None
                       ) -> FoldedNorm | torch.Tensor:
        """`forward` with the norms folded (`layers/norm_fold.py`): x holds this
        MLP's input norm unscaled; the output goes into `target` (None: returned
        as `forward` returns it)."""
        h = self.gate_up_proj.forward_normed(x)
        if self.act_fn is not None:
            h = self.act_fn(h)
        return self.down_proj(h) if target is None else self.down_proj.forward_into_norm(h, target)


def dense_mlp(spec: DecoderSpec, layer_id: int, quant_config: QuantizationConfig | None,
              prefix: str) -> GatedMLP:
    """The dense gated MLP of `spec.intermediate_size`."""
    return GatedMLP(spec, quant_config, prefix)


def moe_mlp(spec: DecoderSpec, layer_id: int, quant_config: QuantizationConfig | None,
            prefix: str) -> SparseMoeBlock:
    """`spec.moe`'s routed experts (Mixtral, Qwen3-MoE, OLMoE)."""
    moe = spec.moe
    assert moe is not None
    experts = FusedMoE(moe.num_experts, spec.hidden_size, moe.intermediate_size,
                       spec.activation, quant_config, prefix=f"{prefix}.experts")
    gate = TopKRouter(moe.num_experts, spec.hidden_size, moe.top_k, moe.renormalize,
                      moe.round_weights, fused_kernel=_experts_on_triton(experts))
    return SparseMoeBlock(gate, experts)


def _experts_on_triton(experts: FusedMoE) -> bool:
    """Whether the experts run on the Triton MoE backend (float experts on CUDA,
    `layers/moe/backends.py`): their router then runs its Triton kernel too. Other
    expert methods (GGUF) have no backend and keep the torch router."""
    backend = getattr(experts.quant_method, "backend", None)
    return backend is not None and backend.name == "triton"


def moe_shared_mlp(spec: DecoderSpec, layer_id: int, quant_config: QuantizationConfig | None,
                   prefix: str) -> SparseMoeBlock:
    """The routed experts plus a shared expert every token takes (Qwen2-MoE),
    scaled by its sigmoid gate where `spec.moe.shared_expert_gate`."""
    block = moe_mlp(spec, layer_id, quant_config, prefix)
    moe = spec.moe
    if not moe.shared_expert_intermediate_size:
        raise ValueError("a shared expert needs shared_expert_intermediate_size > 0")
    block.shared_expert = GatedMLP(spec, quant_config, f"{prefix}.shared_expert",
                                   intermediate_size=moe.shared_expert_intermediate_size)
    if moe.shared_expert_gate:
        block.shared_expert_gate = SharedExpertGate(spec.hidden_size)
    return block


MOE_FACTORIES = (moe_mlp, moe_shared_mlp)


def sparse_layers(num_layers: int, moe_factory: MlpFactory = moe_mlp, *, step: int = 1,
                  dense_layers: Iterable[int] = (), first_dense: int = 0
                  ) -> tuple[MlpFactory, ...]:
    """Per-layer MLP factories: `moe_factory` on every `step`-th layer (layer i
    with (i + 1) % step == 0, Qwen's decoder_sparse_step), dense on
    `dense_layers` (mlp_only_layers) and on the first `first_dense` layers
    (DeepSeek's first_k_dense_replace)."""
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step}: expected >= 1")
    dense = set(dense_layers)
    return tuple(moe_factory if i >= first_dense and i not in dense and (i + 1) % step == 0
                 else dense_mlp for i in range(num_layers))


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_id: int, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        d = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, spec.num_heads, spec.num_kv_heads,
                                          bias=spec.qkv_bias, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        qkv = self.qkv_proj
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, bias=spec.o_bias,
                                        input_partition=(qkv.q_start * d, qkv.q_size),
                                        reduce_results=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.q_norm = spec.norm(d, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = spec.norm(d, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary_emb = rotary_emb
        # The QK norm runs with the rotation (one kernel on CUDA).
        self.rope = (rotary_emb if self.q_norm is None
                     else QKNormRotary(rotary_emb, self.q_norm, self.k_norm))
        self.split_sizes = [qkv.q_size, qkv.kv_size, qkv.kv_size]
        scale = spec.attn_scale if spec.attn_scale is not None else d ** -0.5
        self.attn = RadixAttention(layer_id, qkv.num_heads, qkv.num_kv_heads, d, scaling=scale,
                                   sliding_window=spec.window(layer_id),
                                   logit_softcap=spec.attn_logit_softcap)

    def takes_fp8_input(self, rows: int) -> bool:
        """Whether `forward` takes `rows` rows of `hidden` as `Fp8Rows` (qkv_proj's
        input: a subclass whose forward reads `hidden` otherwise says False)."""
        return self.qkv_proj.takes_fp8_rows(rows)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | Fp8Rows,
                fb: ForwardBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows`: project only these rows of the attention output (every token's
        K/V is still computed and stored)."""
        qkv = self.qkv_proj.forward_unsummed(hidden)
        sums = qkv if isinstance(qkv, SplitSums) else None
        q, k, v = (qkv.out if sums is not None else qkv).split(self.split_sizes, dim=-1)
        out = self.attn(q, k, v, fb, rope=(self.rope, positions), sums=sums)
        return self.o_proj(out if rows is None else out[rows])

    def forward_folded(self, positions: torch.Tensor, x: FoldedNorm, fb: ForwardBatch,
                       target: NormTarget) -> FoldedNorm:
        """`forward` with the norms folded (`layers/norm_fold.py`): x holds the
        input norm unscaled; the output goes into `target`."""
        q, k, v = self.qkv_proj.forward_normed(x).split(self.split_sizes, dim=-1)
        out = self.attn(q, k, v, fb, rope=(self.rope, positions))
        return self.o_proj.forward_into_norm(out, target)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_id: int, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.self_attn = spec.attention_factory(layer_id)(spec, layer_id, rotary_emb, quant_config,
                                                          prefix=f"{prefix}.self_attn")
        self.mlp = spec.mlp_factory(layer_id)(spec, layer_id, quant_config, f"{prefix}.mlp")
        self.input_layernorm = spec.norm(hidden, eps)
        # Llama: the MLP's input norm. Sandwich layers: the attention output's norm.
        self.post_attention_layernorm = spec.norm(hidden, eps)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = spec.norm(hidden, eps)
            self.post_feedforward_layernorm = spec.norm(hidden, eps)

    @property
    def output_norm(self) -> RMSNorm | None:
        """The norm still to apply to this layer's output before it joins the
        residual stream (a sandwich layer's post-feed-forward norm): the next
        norm applies it in the same kernel (`RMSNorm.forward`'s pre_norm)."""
        return self.post_feedforward_layernorm if self.sandwich else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, fb: ForwardBatch,
                rows: torch.Tensor | None = None, pending_norm: RMSNorm | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream): their sum, after
        `output_norm` on the output, is the layer's HF output. The output is a
        per-rank partial sum under tensor parallelism (the MLP's, left for the
        next norm to reduce). `pending_norm`: the previous layer's output_norm.
        `rows`: return only these token rows (the last layer in prefill, where
        only the rows that get logits go on)."""
        # Where the next projection would quantize its input rows to FP8, the norm
        # writes them so (`Fp8Rows`).
        norm = self.input_layernorm
        fp8 = _fp8_norm_out(norm, self.self_attn, hidden)
        if residual is None:
            residual, hidden = hidden, norm(hidden, **fp8)
        else:
            hidden, residual = norm(hidden, residual, reduce=True, pre_norm=pending_norm, **fp8)
        hidden = self.self_attn(positions, hidden, fb, rows)
        if rows is not None:
            residual = residual[rows]
        if self.sandwich:
            hidden, residual = self.pre_feedforward_layernorm(
                hidden, residual, reduce=True, pre_norm=self.post_attention_layernorm)
        elif isinstance(self.mlp, SparseMoeBlock):  # may fold the norm into its router
            return self.mlp.forward_after_norm(hidden, residual, self.post_attention_layernorm)
        else:
            norm = self.post_attention_layernorm
            hidden, residual = norm(hidden, residual, reduce=True,
                                    **_fp8_norm_out(norm, self.mlp, hidden))
        return self.mlp(hidden), residual

    def norm_fold_rows(self) -> int:
        """The most rows at which `forward_folded` runs on kernels that fold the
        norms (0: this layer cannot fold them): a dense Llama-style layer on one
        rank whose four projections' methods fold (`LinearMethod.norm_fold_rows`)."""
        attn, mlp = self.self_attn, self.mlp
        plain = (type(attn) is DecoderAttention and type(mlp) is GatedMLP and not self.sandwich
                 and type(self.input_layernorm) is RMSNorm
                 and type(self.post_attention_layernorm) is RMSNorm)
        if not plain or tp.get_tp_size() > 1:
            return 0
        return min(p.quant_method.norm_fold_rows(p, output) for p, output in
                   ((attn.qkv_proj, False), (attn.o_proj, True), (mlp.gate_up_proj, False),
                    (mlp.down_proj, True)))

    def forward_folded(self, positions: torch.Tensor, x: FoldedNorm, fb: ForwardBatch,
                       next_norm: RMSNorm | None
                       ) -> FoldedNorm | tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the norms folded into the projections around them
        (`layers/norm_fold.py`): x holds this layer's input norm unscaled; returns
        the same for `next_norm` (the next layer's input norm), or where it is
        None (the last layer), (output, residual) as `forward` does."""
        mid = self.self_attn.forward_folded(positions, x, fb, _target(
            self.post_attention_layernorm, x.residual))
        if next_norm is None:
            return self.mlp.forward_folded(mid, None), mid.residual
        return self.mlp.forward_folded(mid, _target(next_norm, mid.residual))


def _fp8_norm_out(norm: nn.Module, block: nn.Module, x: torch.Tensor) -> dict[str, bool]:
    """The norm's keyword asking for `Fp8Rows` where the attention or MLP block after
    it takes its normed input, x's rows, so (CUDA only; blocks that say nothing
    take tensors, and a norm that is no RMSNorm, such as EAGLE's identity, is
    called as it was)."""
    takes = getattr(block, "takes_fp8_input", None)
    if isinstance(norm, RMSNorm) and x.is_cuda and takes is not None and takes(x.shape[0]):
        return {"fp8_out": True}
    return {}


def _target(norm: RMSNorm, residual: torch.Tensor) -> NormTarget:
    return NormTarget(residual, norm.scale, norm.eps)


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, quant_config: QuantizationConfig | None = None,
                 prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size,
                                                   quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        self.embed_scale = None
        if spec.embed_scale is not None:
            # HF rounds the scale to the weights' dtype before multiplying.
            dtype = torch.get_default_dtype()
            self.embed_scale = torch.tensor(spec.embed_scale, dtype=dtype, device="cpu").item()
        # One cos/sin table per distinct rope (they are large for 128k contexts).
        ropes: dict[str | None, RotaryEmbedding] = {}
        for i in range(spec.num_layers):
            kind = spec.rope_layer_type(i)
            if kind not in ropes:
                ropes[kind] = get_rope(spec.config, spec.head_dim, layer_type=kind)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, ropes[spec.rope_layer_type(i)], quant_config,
                         prefix=f"{prefix}.layers.{i}")
            for i in range(spec.num_layers))
        self.norm = spec.norm(spec.hidden_size, spec.rms_norm_eps)
        self.fold_rows = 0  # `enable_norm_fold`

    def enable_norm_fold(self) -> int:
        """Fold the norms into the projections in decode steps of up to as many
        rows as every layer's kernels take (`layers/norm_fold.py`); returns that
        number (0: the norms stay kernels of their own)."""
        self.fold_rows = min(layer.norm_fold_rows() for layer in self.layers)
        return self.fold_rows

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the first layer takes them (scaled where the family
        scales them): what `input_embeds` holds for ordinary tokens."""
        hidden = self.embed_tokens(input_ids)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                last_rows: torch.Tensor | None = None,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden states. With `last_rows` the last layer runs its
        output projection and MLP on those rows only, and only they are
        returned. `input_embeds` [num_tokens, hidden] replaces the embedding
        of `input_ids` (then unused)."""
        hidden = self.embed(input_ids) if input_embeds is None else input_embeds
        if (1 <= hidden.shape[0] <= self.fold_rows and last_rows is None
                and fb.capture is None):
            return self.forward_folded(positions, hidden, fb)
        residual = None
        last = len(self.layers) - 1
        pending = None
        capture = fb.capture.layers if fb.capture is not None else ()
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, fb,
                                     last_rows if i == last else None, pending)
            pending = layer.output_norm
            if i in capture:
                fb.captured.append(_layer_output(hidden, residual, pending))
        # Under tensor parallelism this norm all-reduces the last MLP's partial
        # sums in place (in the buffer the MLP wrote), so rows are picked after it.
        return self.norm(hidden, residual, reduce=True, pre_norm=pending)[0]

    def forward_folded(self, positions: torch.Tensor, hidden: torch.Tensor,
                       fb: ForwardBatch) -> torch.Tensor:
        """`forward` with each norm between two layers' projections folded into
        them (`layers/norm_fold.py`): the first layer's input norm and the last
        norm stay kernels of their own."""
        first = self.layers[0].input_layernorm
        x: Any = FoldedNorm(first(hidden), None, hidden, first.eps)
        for i, layer in enumerate(self.layers):
            following = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            x = layer.forward_folded(positions, x, fb, following)
        hidden, residual = x
        return self.norm(hidden, residual)[0]


def _layer_output(hidden: torch.Tensor, residual: torch.Tensor,
                  output_norm: RMSNorm | None) -> torch.Tensor:
    """The residual stream after a layer (HF's hidden state of it), computed aside:
    the layer's output stays a per-rank partial sum for the next norm to reduce."""
    out = tp.tensor_model_parallel_all_reduce(hidden.clone())
    if output_norm is not None:
        out = output_norm(out)
    return out + residual


class DecoderForCausalLM(nn.Module):
    """A dense decoder with an LM head. Subclasses implement `decoder_spec`."""

    weight_mapping: ClassVar[WeightMapping] = HF_PROJECTIONS

    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        """What `config` asks of the decoder; ValueError naming any field this
        family cannot honour."""
        raise NotImplementedError

    def __init__(self, config: PretrainedConfig,
                 quant_config: QuantizationConfig | None = None) -> None:
        """`quant_config`: picks each linear layer's weight method (default:
        unquantized, with the fast paths of the device and dtype)."""
        super().__init__()
        spec = self.decoder_spec(config)
        self.config = config
        self.spec = spec
        self.model = DecoderModel(spec, quant_config=quant_config)
        check_expert_layers(self)
        self.tie_word_embeddings = spec.tie_word_embeddings
        tied_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tied_to=tied_to,
                                      quant_config=quant_config, prefix="lm_head")
        self.final_logit_softcap = spec.final_logit_softcap

    def enable_norm_fold(self) -> int:
        """`DecoderModel.enable_norm_fold`."""
        return self.model.enable_norm_fold()

    def kv_spec(self) -> KVSpec:
        """What this rank's attention layers keep per token (their share of the
        KV heads under tensor parallelism): what the KV pool is built for."""
        layers = [m for m in self.modules() if isinstance(m, RadixAttention)]
        first = layers[0]
        if any((a.num_kv_heads, a.head_dim) != (first.num_kv_heads, first.head_dim)
               for a in layers):
            raise ValueError("layers with different KV shapes need a per-layer pool")
        return KVSpec(MHA, len(layers), first.num_kv_heads, first.head_dim, first.head_dim,
                      tuple(a.sliding_window for a in layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [len(fb.logit_rows), vocab] for the rows `fb.logit_rows`
        of the flat token axis (default: each request's last new token).
        `input_embeds`: see `DecoderModel.forward`."""
        rows = fb.logit_rows
        if rows is None:
            rows = fb.extend_start_loc + fb.extend_seq_lens - 1
        # Prefill: the last layer's o_proj and MLP only for the logit rows (~3%),
        # unless every row's hidden states are captured.
        every_row = (fb.mode.is_decode_like() or rows.numel() == fb.num_tokens
                     or fb.capture is not None)
        hidden = self.model(input_ids, positions, fb, last_rows=None if every_row else rows,
                            input_embeds=input_embeds)
        if fb.capture is not None and fb.capture.final:
            fb.captured.append(hidden)
        if every_row:
            hidden = hidden[rows]
        return self.compute_logits(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden).float()
        cap = self.final_logit_softcap
        # In float32: HF caps in the model's dtype, which ties many large logits.
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       fb: ForwardBatch, input_embeds: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """Final-normed hidden states [num_tokens, hidden] of every token."""
        return self.model(input_ids, positions, fb, input_embeds=input_embeds)

    # ---- weights ---------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> dict[str, set[ShardId]]:
        """Copy HF-named tensors into place (`models/weight_map.py`); returns, per
        parameter written (our name), the shard ids written, so a caller loading
        a full checkpoint can check nothing is missing (a partial update may
        legitimately write fewer). ValueError for a tensor with no place here."""
        return load_weights(self, weights)


def check_expert_layers(model: nn.Module) -> None:
    """Log how the MoE layers' experts are split and computed (the first
    layer's: they all are alike); ValueError for expert parallelism on a
    model without experts."""
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    ep = tp.moe_parallel()
    if not experts:
        if ep.ep_size > 1:
            raise ValueError(f"ep_size={ep.ep_size}: {type(model).__name__} has no expert "
                             "layers to split")
        return
    logger.info("MoE: %d of %d layers; %s", len(experts), len(model.model.layers),
                experts[0].describe())
