"""What one model forward needs: token ids, positions and where their KV lives."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from radixlm.utils import to_device

if TYPE_CHECKING:
    from radixlm.cache.memory_pool import KVPool, ReqToTokenPool
    from radixlm.layers.attention.base import AttentionBackend


class ForwardMode(Enum):
    EXTEND = auto()  # prefill: new tokens of each request after a cached prefix
    DECODE = auto()  # exactly one new token per request

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Flat (ragged) layout: the new tokens of all requests back to back.

    For request i: `extend_seq_lens[i]` new tokens follow `extend_prefix_lens[i]`
    tokens already in the KV pool; `seq_lens[i]` = prefix + new. The KV slots of
    all its tokens are `req_to_token[req_pool_indices[i], :seq_lens[i]]`, and the
    new ones are also given flat in `out_cache_loc` (the backend writes K/V there).
    In decode mode every extend length is 1.
    """

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    extend_seq_lens: torch.Tensor  # [bs] int64
    extend_prefix_lens: torch.Tensor  # [bs] int64
    extend_start_loc: torch.Tensor  # [bs] int64, exclusive cumsum of extend_seq_lens
    # Host copies, so Python-side loops never sync with the device.
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVPool
    attn_backend: AttentionBackend
    # Rows of the flat token axis whose logits are wanted, [num_logit_rows] int64.
    # Default: the last new token of each request.
    logit_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(cls, mode: ForwardMode, input_ids: list[int], req_pool_indices: list[int],
              prefix_lens: list[int], extend_lens: list[int], out_cache_loc: torch.Tensor,
              req_to_token_pool: ReqToTokenPool, token_to_kv_pool: KVPool,
              attn_backend: AttentionBackend, device: torch.device,
              logit_rows: list[int] | None = None) -> ForwardBatch:
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        positions = [p + j for p, e in zip(prefix_lens, extend_lens) for j in range(e)]
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e

        def t(x: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(x, dtype=torch.int64), device)

        if logit_rows is None:
            logit_rows = [s + e - 1 for s, e in zip(starts, extend_lens)]
        return cls(
            mode=mode, batch_size=len(req_pool_indices), input_ids=t(input_ids),
            positions=t(positions), req_pool_indices=t(req_pool_indices), seq_lens=t(seq_lens),
            out_cache_loc=to_device(out_cache_loc, device),
            extend_seq_lens=t(extend_lens), extend_prefix_lens=t(prefix_lens),
            extend_start_loc=t(starts), seq_lens_cpu=seq_lens, extend_seq_lens_cpu=extend_lens,
            extend_prefix_lens_cpu=prefix_lens, req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool, attn_backend=attn_backend,
            logit_rows=t(logit_rows))
