"""The attention-backend seam.

A backend computes attention for the new tokens of a `ForwardBatch` against
everything the request has in the token-level KV pool, after writing the new
tokens' K/V into their slots (`out_cache_loc`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch, PrefixGroups
    from radixlm.layers.attention.radix_attention import RadixAttention, Rope
    from radixlm.layers.split_sums import SplitSums


@dataclass(frozen=True)
class AttentionShape:
    """What a backend is built for: one rank's attention heads (every layer's)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    max_context_len: int
    # --enable-deterministic-inference: kernels whose rows do not depend on the batch
    # (a backend without such kernels keeps `batch_invariant` False and is refused).
    deterministic: bool = False


class AttentionBackend(ABC):
    """Contract:
    - Construction: `create(shape)` from the runner (the attention backend
      registry, `registry.py`, picks the class); `unusable(device, head_dim)`
      says beforehand why a class cannot run (None: it can).
    - `init_forward_metadata(fb)` is called once per forward before any layer
      runs (through `begin_forward`); per-layer calls may reuse what it computed.
      It only ever sees EXTEND or DECODE batches.
    - Mixed batches (`fb.mode.is_mixed()`: extend requests, then decode requests)
      are handled here for every backend: `begin_forward` prepares metadata for
      both of `fb.mixed_parts()`, and `forward` runs the extend part through
      `forward_extend` and the decode part through `forward_decode`. Metadata of
      the two modes must therefore live side by side (set by separate calls).
    - Verify batches (`fb.mode.is_verify()`: k + 1 rows per request, row j
      attending to the request's KV and its rows 0..j) are handled here too: as
      the decode batch `fb.verify_decode_view()`, one row per token, so a
      verify row computes exactly what a decode step over the same tokens
      computes. A tree of drafts (`fb.tree`: each row sees the request's KV,
      its ancestors and itself, not its siblings) needs a backend with
      `supports_tree_mask`, whose decode path reads the view's per-row slot
      table (`fb.verify_decode_view().req_to_token_pool.req_to_token`) instead
      of the request table (in CUDA graphs: the request table's path rows the
      graph runner fills, `ReqToTokenPool.path_table`); `check_tree_drafts`
      refuses trees at start-up on the others.
    - `forward(q, k, v, layer, fb, rope=None)`: q is [num_tokens, num_heads *
      head_dim], k and v are [num_tokens, num_kv_heads * head_dim] for the new
      tokens. With `rope` = (rotary embedding, positions), q and k are not
      rotated yet: the backend rotates them first (in place or not; a backend
      may fuse it with the store). With `sums` (`layers/split_sums.py`), q, k
      and v are views of `sums.out`, not written yet: the backend first adds
      the partial sums into it (`sums.finish()`), or fuses that with its RoPE.
      The backend stores k/v at `fb.out_cache_loc` in layer `layer.layer_id`
      of the pool, then returns [num_tokens,
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
      compute: never ignore one. Likewise `check_kv_dtype(model, kv)` for a
      KV pool whose dtype differs from the model's (`--kv-cache-dtype`).
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

    # Rows are the same bits whatever the batch, the chunking or the cached prefix
    # (--enable-deterministic-inference refuses a backend without this).
    batch_invariant = False

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    # Layer variants this backend computes (see `check_layer`).
    supports_sliding_window = False
    supports_logit_softcap = False
    # Reads window layers through a window pool's slot map (`KVPool.layer_slot_map`);
    # the model runner gives other backends a plain pool.
    supports_window_pool = False

    # Verifies trees of drafts (the decode path reads any slot table it is given).
    supports_tree_mask = False
    # Reads a KV pool in another float dtype than the model computes in.
    supports_kv_dtype_cast = False

    @classmethod
    def unusable(cls, device: torch.device, head_dim: int) -> str | None:
        """Why this backend cannot run on `device` for heads of `head_dim` (None: it can)."""
        return None

    @classmethod
    def create(cls, shape: AttentionShape) -> AttentionBackend:
        return cls()

    def check_kv_dtype(self, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """ValueError if this backend cannot attend a pool of `kv_dtype` from
        activations of `model_dtype`."""
        if kv_dtype != model_dtype and not self.supports_kv_dtype_cast:
            raise ValueError(f"the {type(self).__name__} needs the KV cache in the model's dtype "
                             f"({str(model_dtype).removeprefix('torch.')}); got "
                             f"--kv-cache-dtype {str(kv_dtype).removeprefix('torch.')}")

    @classmethod
    def check_tree_drafts(cls, topk: int | None) -> None:
        """ValueError if `--speculative-eagle-topk` asks for tree drafts (> 1) and this
        backend cannot verify a tree."""
        if topk is not None and topk > 1 and not cls.supports_tree_mask:
            raise ValueError(f"--speculative-eagle-topk {topk}: tree drafts need tree attention "
                             f"in the verify forward, which the {cls.__name__} does not "
                             "implement in its kernels yet; use --speculative-eagle-topk 1 "
                             "(chains) or an attention backend with tree attention "
                             "(triton, torch_native, cpu)")

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
        elif fb.mode.is_verify():
            self.init_forward_metadata(fb.verify_decode_view())
        else:
            self.init_forward_metadata(fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: RadixAttention, fb: ForwardBatch, rope: Rope | None = None,
                sums: SplitSums | None = None) -> torch.Tensor:
        if sums is not None:
            sums.finish()
        if rope is not None:
            q, k = rope[0](rope[1], q, k)
        if fb.mode.is_mixed():
            return self.forward_mixed(q, k, v, layer, fb)
        if fb.mode.is_verify():
            return self.forward_verify(q, k, v, layer, fb)
        if fb.mode.is_decode():
            return self.forward_decode(q, k, v, layer, fb)
        return self.forward_extend(q, k, v, layer, fb)

    def forward_verify(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch, **kw: bool) -> torch.Tensor:
        """The decode path over one row per token (a chain's or a tree's view); `kw`
        as in `forward_mixed`."""
        if fb.tree is not None and not self.supports_tree_mask:
            raise NotImplementedError(f"the {type(self).__name__} verifies chains of drafts "
                                      "only, not trees")
        return self.forward_decode(q, k, v, layer, fb.verify_decode_view(), **kw)

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
