"""The attention-backend seam.

A backend computes attention for the new tokens of a `ForwardBatch` against
everything the request has in the token-level KV pool, after writing the new
tokens' K/V into their slots (`out_cache_loc`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch, PrefixGroups
    from radixlm.layers.attention.radix_attention import RadixAttention, Rope


class AttentionBackend(ABC):
    """Contract:
    - `init_forward_metadata(fb)` is called once per forward before any layer
      runs (through `begin_forward`); per-layer calls may reuse what it computed.
      It only ever sees EXTEND or DECODE batches.
    - Mixed batches (`fb.mode.is_mixed()`: extend requests, then decode requests)
      are handled here for every backend: `begin_forward` prepares metadata for
      both of `fb.mixed_parts()`, and `forward` runs the extend part through
      `forward_extend` and the decode part through `forward_decode`. Metadata of
      the two modes must therefore live side by side (set by separate calls).
    - `forward(q, k, v, layer, fb, rope=None)`: q is [num_tokens, num_heads *
      head_dim], k and v are [num_tokens, num_kv_heads * head_dim] for the new
      tokens. With `rope` = (rotary embedding, positions), q and k are not
      rotated yet: the backend rotates them first (in place or not; a backend
      may fuse it with the store). The backend stores k/v at `fb.out_cache_loc`
      in layer `layer.layer_id` of the pool, then returns [num_tokens,
      num_heads * head_dim]: each new token attends causally to its request's
      tokens 0..position.
    - Layer variants (`RadixAttention.sliding_window`, `.logit_softcap`): a
      sliding window W means the query at position p attends to the keys at
      positions max(0, p - W + 1) .. p (the last W, its own included: the mask
      of transformers' sliding-window layers, `kv_idx > q_idx - W`, which
      Mistral, Qwen2/3, Phi-3 and Gemma 2/3 all use; the family tests match
      HF on it). A window layer never reads the KV slots of positions before
      its window (a windowed pool may have freed them). A softcap c replaces
      each scaled score s by c * tanh(s / c) before the mask and the softmax.
      `check_layer(layer)` is called for every layer at start-up and raises
      ValueError, naming the feature, for a variant the backend cannot
      compute: never ignore one.
    - CUDA-graph hooks: state sized once for `max_bs`, then metadata for a
      padded batch is written into that state in place, so a captured graph
      replays with new inputs. Backends without graph support keep the
      defaults, which raise.
    - Cascade (prefix-sharing) decode, for backends with
      `supports_cascade_decode`: `fb.prefix_groups` lists requests that share
      their first KV slots; `init_cuda_graph_state(max_bs, cascade=True)` has the
      graphs capture that path, and `init_forward_metadata_cuda_graph(...,
      prefix_groups=...)` hands each replay its batch's groups. Other backends
      ignore the groups (decode reads each request's KV in full).
    """

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    # Layer variants this backend computes (see `check_layer`).
    supports_sliding_window = False
    supports_logit_softcap = False
    # Reads window layers through a window pool's slot map (`KVPool.layer_slot_map`);
    # the model runner gives other backends a plain pool.
    supports_window_pool = False

    def check_layer(self, layer: RadixAttention) -> None:
        """ValueError if `layer` needs something this backend does not compute."""
        name = type(self).__name__
        if layer.sliding_window is not None and not self.supports_sliding_window:
            raise ValueError(f"layer {layer.layer_id} uses sliding-window attention (window "
                             f"{layer.sliding_window}), which the {name} does not implement")
        if layer.logit_softcap is not None and not self.supports_logit_softcap:
            raise ValueError(f"layer {layer.layer_id} uses attention logit softcapping "
                             f"({layer.logit_softcap}), which the {name} does not implement")

    def begin_forward(self, fb: ForwardBatch) -> None:
        """What the model runner calls once per eager forward."""
        if fb.mode.is_mixed():
            for part in fb.mixed_parts():
                self.init_forward_metadata(part)
        else:
            self.init_forward_metadata(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: RadixAttention, fb: ForwardBatch, rope: Rope | None = None
                ) -> torch.Tensor:
        if rope is not None:
            q, k = rope[0](rope[1], q, k)
        if fb.mode.is_mixed():
            return self.forward_mixed(q, k, v, layer, fb)
        if fb.mode.is_decode():
            return self.forward_decode(q, k, v, layer, fb)
        return self.forward_extend(q, k, v, layer, fb)

    def forward_mixed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      layer: RadixAttention, fb: ForwardBatch, **kw: bool) -> torch.Tensor:
        """The extend part's rows, then the decode part's, each by its own path;
        `kw` goes to both (e.g. a backend's `kv_stored`)."""
        extend, decode = fb.mixed_parts()
        n = extend.num_tokens
        out_e = self.forward_extend(q[:n], k[:n], v[:n], layer, extend, **kw)
        out_d = self.forward_decode(q[n:], k[n:], v[n:], layer, decode, **kw)
        return torch.cat([out_e, out_d])

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor: ...

    # ---- CUDA graphs ---------------------------------------------------
    supports_cuda_graph = False
    supports_cascade_decode = False

    def init_cuda_graph_state(self, max_bs: int, cascade: bool = False) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                         seq_lens: torch.Tensor,
                                         prefix_groups: PrefixGroups | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
