"""Reference attention over the token-level KV pool with torch SDPA (CPU and checks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixlm.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch
    from radixlm.layers.attention.radix_attention import RadixAttention


def _extend_runs(prefix_lens: list[int],
                 extend_lens: list[int]) -> list[tuple[int, int, int, int]]:
    """(first request, prefix, extend, count): consecutive requests without a cached
    prefix and with equal extend lengths form one run; one with a prefix is alone."""
    runs: list[tuple[int, int, int, int]] = []
    for i, (pre, ext) in enumerate(zip(prefix_lens, extend_lens)):
        if runs and pre == 0 and runs[-1][1] == 0 and runs[-1][2] == ext:
            runs[-1] = runs[-1][:3] + (runs[-1][3] + 1,)
        else:
            runs.append((i, pre, ext, 1))
    return runs


def band_mask(q_start: int, num_q: int, k_start: int, num_k: int, window: int | None,
              device: torch.device) -> torch.Tensor | None:
    """[num_q, num_k] bool, True where query i (at position q_start + i) sees key j
    (at position k_start + j): the key is not later than the query and, with a
    window W, fewer than W positions before it (the contract in base.py). None
    when every query sees every key."""
    last_q, first_k, last_k = q_start + num_q - 1, k_start, k_start + num_k - 1
    if last_k <= q_start and (window is None or first_k > last_q - window):
        return None
    q = torch.arange(q_start, q_start + num_q, device=device)[:, None]
    k = torch.arange(k_start, k_start + num_k, device=device)[None, :]
    mask = k <= q
    return mask if window is None else mask & (k > q - window)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         layer: RadixAttention, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with scores s -> c * tanh(s / c) before the mask and softmax (Gemma 2),
    in float32. q [B, H, Lq, d], k/v [B, KVH, Lk, d]; `mask` bool, broadcastable
    to [B, H, Lq, Lk], True where a query attends."""
    b, h, lq, d = q.shape
    kvh = k.shape[1]
    qg = q.float().view(b, kvh, h // kvh, lq, d)  # the query heads of each KV head
    scores = qg @ k.float().unsqueeze(2).transpose(-1, -2) * layer.scaling
    cap = layer.logit_softcap
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        mask = mask.view(*mask.shape[:-3], 1, *mask.shape[-3:]) if mask.dim() == 4 else mask
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.float().unsqueeze(2)
    return out.view(b, h, lq, d).to(q.dtype)


def _dequant(fb: ForwardBatch, layer: RadixAttention, k: torch.Tensor, v: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered pool rows in the queries' dtype, scaled back where the pool quantized
    them (no-ops for a pool in the model's dtype)."""
    scales = fb.token_to_kv_pool.layer_scales(layer.layer_id)
    if scales is None:
        return k.to(dtype), v.to(dtype)
    return (k.float() * scales[0]).to(dtype), (v.float() * scales[1]).to(dtype)


class TorchNativeBackend(AttentionBackend):
    supports_sliding_window = True
    supports_logit_softcap = True
    supports_kv_dtype_cast = True  # pool rows are cast to the queries' dtype when read
    # Trees: the decode path gathers through the verify view's per-row slot table,
    # a gather that is the tree mask (a row reads its prefix and its path only).
    supports_tree_mask = True

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode.is_decode():
            # Decode: gather every request's KV through one padded index matrix
            # [bs, max_len]; padded positions point at slot 0 and are masked.
            max_len = max(fb.seq_lens_cpu)
            table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].long()
            arange = torch.arange(max_len, device=table.device)
            valid = arange[None, :] < fb.seq_lens[:, None]
            self.decode_kv_index = torch.where(valid, table, 0)
            self.decode_mask = valid[:, None, None, :]  # [bs, 1, 1, max_len]
            self._decode_fb = fb
            self._window_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _decode_view(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(KV slot index [bs, n], mask [bs, 1, 1, n]) of what each decode query
        sees: everything, or with a window only its last `window` tokens (never
        reading the slots before them, which a windowed pool may have freed)."""
        fb = self._decode_fb
        if window is None or window >= max(fb.seq_lens_cpu):
            return self.decode_kv_index, self.decode_mask
        if window not in self._window_views:
            start = (fb.seq_lens - window).clamp(min=0)
            pos = start[:, None] + torch.arange(window, device=start.device)
            valid = pos < fb.seq_lens[:, None]
            table = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[:, None], pos].long()
            self._window_views[window] = (torch.where(valid, table, 0),
                                          valid[:, None, None, :])
        return self._window_views[window]

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
               fb: ForwardBatch) -> None:
        fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        self._store(k, v, layer, fb)
        h, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q, k, v = q.view(-1, h, d), k.view(-1, kvh, d), v.view(-1, kvh, d)
        out = torch.empty_like(q)
        start = 0
        for i, pre, ext, count in _extend_runs(fb.extend_prefix_lens_cpu,
                                               fb.extend_seq_lens_cpu):
            rows = slice(start, start + count * ext)
            if pre == 0:
                # Fresh prompts of one length: their keys are this batch's new k/v,
                # so no gather from the pool, and one batched SDPA call for all.
                keys = k[rows].view(count, ext, kvh, d).transpose(1, 2)
                values = v[rows].view(count, ext, kvh, d).transpose(1, 2)
                qi = q[rows].view(count, ext, h, d).transpose(1, 2)
                causal = ext > 1 and layer.sliding_window is None
                mask = None if causal else band_mask(0, ext, 0, ext, layer.sliding_window,
                                                     q.device)
                oi = self._sdpa(qi, keys, values, layer, mask, causal)
                out[rows] = oi.transpose(1, 2).reshape(count * ext, h, d)
            else:
                out[rows] = self._extend_one(q[rows], i, pre, ext, layer, fb)
            start += count * ext
        return out.view(-1, h * d)

    def _extend_one(self, q: torch.Tensor, i: int, pre: int, ext: int, layer: RadixAttention,
                    fb: ForwardBatch) -> torch.Tensor:
        """Request i's `ext` new tokens after `pre` cached ones, keys read from the
        pool: positions from the first one a query sees (0, or with a window W
        pre - W + 1) on."""
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        window, total = layer.sliding_window, pre + ext
        first = 0 if window is None else max(0, pre - window + 1)
        slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[i], first:total].long()
        keys, values = _dequant(fb, layer, k_buf[slots], v_buf[slots], q.dtype)
        keys = keys.transpose(0, 1).unsqueeze(0)  # [1, kvh, total - first, d]
        values = values.transpose(0, 1).unsqueeze(0)
        mask = band_mask(pre, ext, first, total - first, window, q.device)
        oi = self._sdpa(q.transpose(0, 1).unsqueeze(0), keys, values, layer, mask)
        return oi[0].transpose(0, 1)

    @staticmethod
    def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
              mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
        """Attention of q [B, H, Lq, d] to k/v [B, KVH, Lk, d] under `mask` (bool,
        True: attends; broadcastable to [B, H, Lq, Lk]; None: all) or, with
        `causal`, SDPA's own causal mask (Lq == Lk, from position 0)."""
        if layer.logit_softcap is not None:
            if causal:
                mask = band_mask(0, q.shape[-2], 0, k.shape[-2], None, q.device)
            return softcapped_attention(q, k, v, layer, mask)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        self._store(k, v, layer, fb)
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        bs = fb.batch_size
        q = q.view(bs, layer.num_heads, 1, layer.head_dim)
        kv_index, mask = self._decode_view(layer.sliding_window)
        dtype = q.dtype
        keys, values = _dequant(fb, layer, k_buf[kv_index], v_buf[kv_index], dtype)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [bs, kvh, n, d]
        if q.device.type == "cpu" and dtype != torch.float32:
            # CPU SDPA's half-precision path for one query row is several times slower
            # than its float32 path (measured 33 vs 14 ms per layer for bf16 at 64 x 320
            # tokens, conversions included): gather in the pool's dtype, attend in fp32.
            q, keys, values = q.float(), keys.float(), values.float()
        out = self._sdpa(q, keys, values, layer, mask)
        return out.to(dtype).reshape(bs, layer.num_heads * layer.head_dim)
