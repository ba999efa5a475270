"""EAGLE and EAGLE-3 draft heads, in the checkpoint layouts SafeAILab publishes.

Both predict the target's next hidden state from the token just chosen and the
target's hidden state at the position before it, then read a token from it:

- EAGLE (EAGLE-1/2, `LlamaForCausalLMEagle`): h = fc([embed(token); feature])
  (fc: 2H -> H with a bias), then Llama decoder layers, the first without its
  input norm, and no final norm; the output is the next feature, and the
  target's LM head turns it into logits. The feature is the target's
  final-normed hidden state (what its LM head reads) or, further down a draft
  chain, the head's own output. Checkpoint names: `fc.*`, `layers.N.*`,
  optionally `embed_tokens.weight` (else the target's embedding).
- EAGLE-3 (`LlamaForCausalLMEagle3`): the target's states after a low, a middle
  and a high layer, concatenated (3 H_target) and mapped by `fc` (3 H_target ->
  H, no bias), or the head's own pre-norm output further down a chain; one
  layer (`midlayer`) whose attention reads [input_layernorm(embed);
  hidden_norm(feature)] (q/k/v over 2H), the feature as its residual; a final
  `norm` and an own LM head over a smaller draft vocabulary whose id i is target
  id i + d2t[i] (`d2t`; the checkpoint's `t2d` is not needed). Names:
  `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`,
  optionally `embed_tokens.weight`.

The second input, one feature row per token, is bound before each forward
(`bind_features`): a static buffer for forwards the draft runner may replay
from CUDA graphs, the rows themselves otherwise. Each forward appends its
output features (the next step's input) to `fb.captured`. The target's
embedding and LM head, where the checkpoint has none, are shared after loading
(`share_target`); `config.draft_has_embedding` / `draft_has_lm_head` say which
the checkpoint holds (the drafter sets them from its tensor names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PretrainedConfig

from radixlm import distributed as tp
from radixlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixlm.layers.linear import ColumnParallelLinear, QKVParallelLinear
from radixlm.layers.norm import RMSNorm
from radixlm.layers.quantization import QuantizationConfig
from radixlm.layers.rotary import get_rope
from radixlm.layers.sharding import WeightSpec
from radixlm.models.decoder import (
    HF_PROJECTIONS,
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderSpec,
    GatedMLP,
)
from radixlm.models.llama import LlamaForCausalLM
from radixlm.models.weight_map import WeightMapping

if TYPE_CHECKING:
    from radixlm.cache.kv_spec import KVSpec
    from radixlm.forward_batch import ForwardBatch


class _IndexSpec(WeightSpec):
    """A replicated integer table (EAGLE-3's d2t)."""

    checkpoint_dtypes = frozenset({torch.int64, torch.int32})


class EagleDraftModel(nn.Module):
    """What the two heads share: the bound features, the shared target parts, logits."""

    draft_only = True  # a head, not a model: it cannot serve as the target
    weight_mapping = HF_PROJECTIONS

    def __init__(self, config: PretrainedConfig, feature_size: int,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.config = config
        self.spec: DecoderSpec = LlamaForCausalLM.decoder_spec(config)
        self.feature_size = feature_size
        self._features: torch.Tensor | None = None
        self._static: torch.Tensor | None = None
        self._target_parts: tuple[Any, ...] = ()  # (embedding, lm head), not our parameters
        h, vocab = self.spec.hidden_size, self.spec.vocab_size
        if getattr(config, "draft_has_embedding", True):
            self.embed_tokens = VocabParallelEmbedding(vocab, h, quant_config=quant_config,
                                                       prefix="embed_tokens")

    # ---- inputs ------------------------------------------------------------------
    def allocate_static_features(self, rows: int, device: torch.device) -> None:
        """A feature buffer the CUDA graphs read (bound until `bind_features`)."""
        self._static = torch.zeros((rows, self.feature_size), device=device)
        self._features = self._static

    def bind_features(self, rows: torch.Tensor) -> None:
        """The feature rows the next forward reads (one per token, flat order); copied
        into the static buffer when they fit, so a replayed graph sees them."""
        static = self._static
        if static is not None and rows.shape[0] <= static.shape[0]:
            static[:rows.shape[0]].copy_(rows)
            self._features = static
        else:
            self._features = rows

    def prepare_target_features(self, states: torch.Tensor) -> torch.Tensor:
        """The target's captured states of a row -> this head's feature input."""
        return states

    # ---- the target's parts ----------------------------------------------------------
    def share_target(self, target: DecoderForCausalLM) -> None:
        embed = getattr(self, "embed_tokens", None)
        head = getattr(self, "lm_head", None)
        self._target_parts = (target.model.embed_tokens if embed is None else embed,
                              target.lm_head if head is None else head)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._target_parts[0](input_ids)

    def logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        rows = fb.logit_rows
        if rows is None:
            rows = fb.extend_start_loc + fb.extend_seq_lens - 1
        return self._target_parts[1].compute_logits(hidden[rows]).float()

    def kv_spec(self) -> KVSpec:
        return DecoderForCausalLM.kv_spec(self)

    def features_in(self, n: int) -> torch.Tensor:
        assert self._features is not None, "bind_features before a forward"
        return self._features[:n]


class EagleForCausalLM(EagleDraftModel):
    """EAGLE-1/2's head (see the module docstring)."""

    def __init__(self, config: PretrainedConfig,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, config.hidden_size, quant_config)
        spec = self.spec
        h = spec.hidden_size
        self.fc = ColumnParallelLinear(2 * h, h, bias=getattr(config, "bias", True),
                                       gather_output=True, quant_config=quant_config,
                                       prefix="fc")
        rope = get_rope(config, spec.head_dim)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, rope, quant_config,
                                                 prefix=f"layers.{i}")
                                    for i in range(spec.num_layers))
        # The first layer reads fc's output as it is (EAGLE's cnets.py skips that norm).
        self.layers[0].input_layernorm = nn.Identity()
        if not getattr(config, "draft_has_lm_head", False):
            return
        self.lm_head = ParallelLMHead(spec.vocab_size, h, quant_config=quant_config,
                                      prefix="lm_head")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        feats = self.features_in(input_ids.shape[0])
        hidden = self.fc(torch.cat([self.embed(input_ids), feats.to(self.fc_dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb)
        out = tp.tensor_model_parallel_all_reduce(hidden) + residual  # no final norm
        fb.captured.append(out)
        return self.logits(out, fb)

    @property
    def fc_dtype(self) -> torch.dtype:
        return self.fc.params_dtype


class Eagle3ForCausalLM(EagleDraftModel):
    """EAGLE-3's head (see the module docstring)."""

    weight_mapping = WeightMapping(fused=HF_PROJECTIONS.fused,
                                   skipped=HF_PROJECTIONS.skipped + ("t2d",))

    def __init__(self, config: PretrainedConfig,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, config.hidden_size, quant_config)
        spec = self.spec
        h, eps = spec.hidden_size, spec.rms_norm_eps
        if spec.num_layers != 1:
            raise ValueError(f"num_hidden_layers={spec.num_layers}: an EAGLE-3 head has one "
                             "decoder layer (midlayer)")
        target_h = getattr(config, "target_hidden_size", None) or h
        self.fc = ColumnParallelLinear(3 * target_h, h, bias=getattr(config, "bias", False),
                                       gather_output=True, quant_config=quant_config,
                                       prefix="fc")
        self.midlayer = _Eagle3Layer(spec, get_rope(config, spec.head_dim), quant_config)
        self.norm = RMSNorm(h, eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or spec.vocab_size
        if getattr(config, "draft_has_d2t", self.draft_vocab_size != spec.vocab_size):
            d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64),
                               requires_grad=False)
            d2t.weight_spec = _IndexSpec()
            self.d2t = d2t
        self.register_buffer("hot_ids", torch.arange(self.draft_vocab_size), persistent=False)
        if spec.tie_word_embeddings:
            if not hasattr(self, "embed_tokens") or self.draft_vocab_size != spec.vocab_size:
                raise ValueError("tie_word_embeddings: an EAGLE-3 head tied to its embedding "
                                 "needs embed_tokens in the checkpoint and no draft vocabulary")
            self.lm_head = ParallelLMHead(spec.vocab_size, h, tied_to=self.embed_tokens,
                                          quant_config=quant_config, prefix="lm_head")
        elif getattr(config, "draft_has_lm_head", True):
            self.lm_head = ParallelLMHead(self.draft_vocab_size, h, quant_config=quant_config,
                                          prefix="lm_head")
        elif self.draft_vocab_size != spec.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} but the checkpoint has "
                             "no lm_head: only a head over the target's vocabulary can share "
                             "the target's")

    def process_weights_after_loading(self) -> None:
        if hasattr(self, "d2t"):
            ids = torch.arange(self.draft_vocab_size, device=self.d2t.device)
            self.hot_ids = self.d2t.data + ids

    def prepare_target_features(self, states: torch.Tensor) -> torch.Tensor:
        return self.fc(states.to(self.fc.params_dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's."""
        return self.hot_ids[draft_ids]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        feats = self.features_in(input_ids.shape[0])
        hidden, residual = self.midlayer(positions, self.embed(input_ids), feats, fb)
        normed, prenorm = self.norm(hidden, residual, reduce=True)
        fb.captured.append(prenorm)  # the next step's feature: before the norm
        return self.logits(normed, fb)


class _Eagle3Layer(nn.Module):
    def __init__(self, spec: DecoderSpec, rope: Any,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.self_attn = DecoderAttention(spec, 0, rope, quant_config, prefix="midlayer.self_attn")
        # Its q/k/v read the token's and the feature's halves side by side.
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * h, spec.head_dim, spec.num_heads, spec.num_kv_heads, bias=False,
            quant_config=quant_config, prefix="midlayer.self_attn.qkv_proj")
        self.mlp = GatedMLP(spec, quant_config, prefix="midlayer.mlp")
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, feats: torch.Tensor,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        residual = feats.to(embeds.dtype)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(residual)], dim=-1)
        x = self.self_attn(positions, x, fb)
        x, residual = self.post_attention_layernorm(x, residual, reduce=True)
        return self.mlp(x), residual
