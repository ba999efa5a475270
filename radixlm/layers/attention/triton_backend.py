"""Attention backend on the Triton kernels in `triton_ops` (CUDA; see docs/kernels.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixlm.cache.fp8_pool import FP8_DTYPES, FP8TokenToKVPool
from radixlm.cache.memory_pool import row_kv_buffers
from radixlm.layers.attention.base import AttentionBackend, AttentionShape
from radixlm.layers.attention.triton_ops.cascade_decode import (
    MAX_PREFIX_SPLITS,
    SPLIT_ALIGN,
    CascadePlan,
    CascadeTables,
    build_cascade_plan,
    cascade_decode_fwd,
    cascade_members,
    table_size,
    table_views,
)
from radixlm.layers.attention.triton_ops.decode_attention import (
    DECODE_BLOCK_N,
    decode_attention_fwd,
)
from radixlm.layers.attention.triton_ops.extend_attention import (
    build_extend_block_table,
    extend_attention_fwd,
    extend_config,
)
from radixlm.layers.attention.triton_ops.invariant_attention import (
    alloc_invariant_scratch,
    build_tiles,
    decode_programs,
    invariant_decode_fwd,
    invariant_extend_fwd,
    num_splits,
    split_size,
)
from radixlm.layers.attention.triton_ops.kv_store import store_kv
from radixlm.layers.fused_ops import apply_rope_
from radixlm.utils import to_device

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from radixlm.forward_batch import ForwardBatch, PrefixGroups
    from radixlm.layers.attention.radix_attention import RadixAttention, Rope
    from radixlm.layers.split_sums import SplitSums


@dataclass
class _CascadeMeta:
    tables: CascadeTables  # device views
    mid_po: torch.Tensor  # [>= bs, num_heads, MAX_PREFIX_SPLITS, head_dim] fp32 scratch
    mid_plse: torch.Tensor  # [>= bs, num_heads, MAX_PREFIX_SPLITS] fp32 scratch


@dataclass
class _DecodeMeta:
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs]
    mid_o: torch.Tensor  # [bs, num_heads, num_splits, head_dim] fp32 scratch
    mid_lse: torch.Tensor  # [bs, num_heads, num_splits] fp32 scratch
    num_splits: int
    cascade: _CascadeMeta | None = None
    # Deterministic mode: (mid_o, mid_m, mid_l) for every split, programs per tile.
    invariant: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    programs: int = 1


@dataclass
class _ExtendMeta:
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Block tables by block_m, built by the first layer and reused by the rest.
    tables: dict[int, torch.Tensor] = field(default_factory=dict)


class TritonAttentionBackend(AttentionBackend):
    """Decode: GQA-grouped split-KV flash-decoding; extend: tiled causal flash attention.

    Constructor: `TritonAttentionBackend(num_heads, num_kv_heads, head_dim, device,
    max_context_len=None, max_kv_splits=64, programs_per_sm=4, kv_store_min_tokens=1)`.
    - num_heads / num_kv_heads / head_dim: this rank's attention shape (the same for
      every layer that uses the backend); head_dim a power of 2 <= 256.
    - max_context_len: if given, caps the number of KV splits (no split shorter
      than one key block).
    - max_kv_splits, programs_per_sm: the split policy. Decode launches
      bs * num_kv_heads * num_splits stage-1 programs with
      num_splits = clamp(ceil(programs_per_sm * num_SMs / (bs * num_kv_heads)), 1,
      max_kv_splits): a function of the batch size only, so one long request still
      spreads over all SMs and a CUDA graph captured for a batch size keeps its
      grid. Each request cuts its own tokens into that many chunks on the device.

    - kv_store_min_tokens: batches with at least this many new tokens store K/V
      with the one-launch Triton kernel (`triton_ops.kv_store`), smaller ones with
      the pool's `set_kv_buffer` (two index_put). The Triton store measured faster
      at every size on H200 (1.6 vs 6.4 us at 32 tokens in a CUDA graph, 36 vs
      155 us at 16k tokens), hence the default 1. Those batches store K/V in the
      RoPE kernel itself when `forward` gets `rope` (full rotary, plain pool).

    Cascade (prefix-sharing) decode: a decode batch whose `fb.prefix_groups` lists
    requests sharing their first KV slots reads each shared prefix once per group
    of requests (`triton_ops.cascade_decode`); the plan is rebuilt on the host only
    when the groups object changes. Needs >= 2 requests per pass-1 program
    (`supports_cascade_decode`: GQA ratio <= 32).

    Layer variants (`check_layer` accepts them all): sliding windows and logit
    softcaps are compile-time branches of the kernels, per layer (the plain
    path is unchanged); a window layer's decode is plain even when the batch's
    graphs capture the cascade path. With a window pool (`SWAKVPool`,
    `supports_window_pool`) a window layer's K/V live at window slots: the
    kernels translate the table's full slots through the pool's slot map, and
    the store writes at the translated slots.

    FP8 KV pools (`FP8TokenToKVPool`, --kv-cache-dtype fp8_e4m3 / fp8_e5m2): the
    store writes K / k_scale and V / v_scale in FP8 (`store_kv` with the layer's
    scales: the codes of the pool's `set_kv_buffer`), and every kernel reads
    FP8 tiles, widened to the queries' dtype, with k_scale folded into the
    score scale and v_scale applied to the normalized output. The scales are
    read from the pool's device tensors inside the kernels (no host sync; graphs
    replay new values). RoPE then runs without the fused store.

    Decode never synchronizes with the host. The new tokens' K/V are stored in
    the pool before the kernels read it (extend reads the new keys from there).

    Deterministic mode (`deterministic=True`, --enable-deterministic-inference):
    decode and extend run `triton_ops.invariant_attention`, whose rows are the
    same bits whatever the batch, the chunking or the cached prefix (a split of
    `split_size(max_context_len)` positions fixed for the process); cascade
    decode is off (its shared-prefix pass cuts a request's keys by its group).

    Trees of drafts (`supports_tree_mask`): a verify batch runs as its decode view
    (`ForwardBatch.verify_decode_view`), and every decode kernel here (split-KV,
    cascade, the deterministic one) reads a row's slots as
    `req_to_token[req_pool_indices[row], :seq_len]` of the table it is handed,
    with the table's own row stride: the view's per-row path table in eager
    mode, the request table's path rows (`ReqToTokenPool.path_table`, filled by
    the graph runner) in CUDA graphs. The table's columns are positions, so a
    window layer's keys (the last W positions of the row's path) and a window
    pool's slot map read as in a decode step; the view has no prefix groups,
    so cascade decode runs its plain pass (graphs: an all-zero plan). A tree
    row thus computes exactly the decode step after its path, bit for bit in
    deterministic mode (tests/gpu/test_tree_attention.py).

    CUDA graphs (decode only): call `init_cuda_graph_state(max_bs)` once, then,
    before each capture and each replay (outside the graph),
    `init_forward_metadata_cuda_graph(bs, req_pool_indices, seq_lens)`. It copies
    the indices and lengths into the backend's static buffers (device copies, no
    sync) and points the decode metadata at slices of preallocated scratch, so
    the captured kernels read the new values on replay. Do not call
    `init_forward_metadata` for a batch that is being captured. With
    `init_cuda_graph_state(max_bs, cascade=True)` the graphs capture the cascade
    path (its tables live in static buffers, zero when a batch has no groups) and
    `init_forward_metadata_cuda_graph(..., prefix_groups=...)` writes a batch's
    plan there (one host-to-device copy, only when the groups changed).
    """

    supports_cuda_graph = True
    supports_cascade_decode = True
    supports_sliding_window = True
    supports_logit_softcap = True
    supports_window_pool = True
    supports_tree_mask = True  # see "Trees of drafts" above

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str, max_context_len: int | None = None,
                 max_kv_splits: int = 64, programs_per_sm: int = 4,
                 kv_store_min_tokens: int = 1, deterministic: bool = False) -> None:
        assert num_heads % num_kv_heads == 0
        assert head_dim & (head_dim - 1) == 0 and head_dim <= 256, "head_dim: power of 2 <= 256"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:  # Triton interpreter runs (debugging): any value works
            self.num_sms = 132
        self.max_kv_splits = max_kv_splits
        if max_context_len is not None:
            self.max_kv_splits = max(1, min(max_kv_splits, -(-max_context_len // DECODE_BLOCK_N)))
        self.programs_per_sm = programs_per_sm
        self.kv_store_min_tokens = kv_store_min_tokens
        group = num_heads // num_kv_heads
        self.cascade_members = cascade_members(group, head_dim)
        # A pass-1 program must hold >= 2 requests (GQA ratio <= 32) to save reads.
        self.supports_cascade_decode = self.cascade_members >= 2
        self.batch_invariant = deterministic
        context = max_context_len or 32768
        self.split = split_size(context)
        self.max_invariant_splits = num_splits(context)
        if deterministic and self.supports_cascade_decode:
            self.supports_cascade_decode = False
            logger.info("deterministic inference: cascade decode off (its shared-prefix pass "
                        "divides a request's keys by the group it decodes with)")
        # Pass-1 items: twice the split policy's program target, so that 2+ splits
        # per group fit for as many groups as fill the GPU.
        target = programs_per_sm * self.num_sms
        self.max_cascade_items = max(64, 2 * -(-target // num_kv_heads))
        self._decode: _DecodeMeta | None = None
        self._extend: _ExtendMeta | None = None
        self._cg: dict[str, torch.Tensor] | None = None
        self._cg_cascade: _CascadeMeta | None = None
        self._cg_groups: PrefixGroups | None = None
        self._cg_tables_buf: torch.Tensor | None = None
        self._plan_groups: PrefixGroups | None = None
        self._plan_value: CascadePlan | None = None
        # (full slots, their window-pool slots, made in a graph capture) of the
        # forward's new tokens.
        self._window_loc: tuple[torch.Tensor, torch.Tensor, bool] | None = None

    @classmethod
    def create(cls, shape: AttentionShape) -> TritonAttentionBackend:
        return cls(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.device,
                   shape.max_context_len, deterministic=shape.deterministic)

    @classmethod
    def unusable(cls, device: torch.device, head_dim: int) -> str | None:
        if head_dim & (head_dim - 1) or head_dim > 256:
            return f"head_dim {head_dim} is not a power of 2 <= 256"
        return None

    def check_kv_dtype(self, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """FP8 pools are read by the kernels (class docstring); other dtypes than
        the model's are refused."""
        if kv_dtype in FP8_DTYPES:
            return
        super().check_kv_dtype(model_dtype, kv_dtype)

    def num_kv_splits(self, bs: int) -> int:
        target = self.programs_per_sm * self.num_sms
        pairs = max(1, bs * self.num_kv_heads)
        return max(1, min(self.max_kv_splits, -(-target // pairs)))

    # ---- metadata ------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._window_loc = None
        if fb.mode.is_decode():
            bs = fb.batch_size
            s = self.num_kv_splits(bs)
            mid_o = torch.empty((bs, self.num_heads, s, self.head_dim), dtype=torch.float32,
                                device=self.device)
            mid_lse = torch.empty((bs, self.num_heads, s), dtype=torch.float32,
                                  device=self.device)
            self._decode = _DecodeMeta(fb.req_pool_indices, fb.seq_lens, mid_o, mid_lse, s,
                                       self._eager_cascade(fb.prefix_groups, bs))
            if self.batch_invariant:
                self._decode.invariant = alloc_invariant_scratch(
                    bs, self.num_heads, self.max_invariant_splits, self.head_dim, self.device)
                self._decode.programs = self._invariant_programs(bs)
        else:
            self._extend = _ExtendMeta(list(fb.extend_prefix_lens_cpu),
                                       list(fb.extend_seq_lens_cpu))

    def _invariant_programs(self, bs: int) -> int:
        return decode_programs(bs, self.num_kv_heads, self.num_heads // self.num_kv_heads,
                               self.num_sms, self.programs_per_sm)

    def _plan(self, groups: PrefixGroups | None) -> CascadePlan | None:
        """The groups' cascade plan (host tables), cached for the last groups object."""
        if groups is not self._plan_groups:
            self._plan_groups = groups
            self._plan_value = None
            if groups is not None and self.supports_cascade_decode:
                self._plan_value = build_cascade_plan(
                    groups.groups, groups.batch_size, self.cascade_members, self.num_kv_heads,
                    self.programs_per_sm * self.num_sms, self.max_cascade_items, SPLIT_ALIGN)
        return self._plan_value

    def _cascade_scratch(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, d, p = self.num_heads, self.head_dim, MAX_PREFIX_SPLITS
        return (torch.empty((bs, h, p, d), dtype=torch.float32, device=self.device),
                torch.empty((bs, h, p), dtype=torch.float32, device=self.device))

    def _eager_cascade(self, groups: PrefixGroups | None, bs: int) -> _CascadeMeta | None:
        if groups is None:
            return None
        assert groups.batch_size == bs, "prefix groups of another batch"
        plan = self._plan(groups)
        if plan is None:
            return None
        buf = to_device(plan.pack(bs, plan.num_items), self.device)
        tables = table_views(buf, bs, plan.num_items, self.cascade_members)
        return _CascadeMeta(tables, *self._cascade_scratch(bs))

    def init_cuda_graph_state(self, max_bs: int, cascade: bool = False) -> None:
        """`cascade`: capture the cascade decode path (see the class docstring)."""
        s = self.num_kv_splits(1)  # the policy's largest split count
        h, d, dev = self.num_heads, self.head_dim, self.device
        self._cg = {
            "req_pool_indices": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "mid_o": torch.empty((max_bs, h, s, d), dtype=torch.float32, device=dev),
            "mid_lse": torch.empty((max_bs, h, s), dtype=torch.float32, device=dev),
        }
        if self.batch_invariant:
            (self._cg["inv_o"], self._cg["inv_m"], self._cg["inv_l"]) = alloc_invariant_scratch(
                max_bs, h, self.max_invariant_splits, d, dev)
        self._cg_cascade = None
        if cascade and self.supports_cascade_decode:
            m, items = self.cascade_members, self.max_cascade_items
            self._cg_tables_buf = torch.zeros(table_size(max_bs, items, m), dtype=torch.int32,
                                              device=dev)
            tables = table_views(self._cg_tables_buf, max_bs, items, m)
            tables.members.fill_(-1)
            self._cg_cascade = _CascadeMeta(tables, *self._cascade_scratch(max_bs))
            self._cg_groups = None

    def init_forward_metadata_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                         seq_lens: torch.Tensor,
                                         prefix_groups: PrefixGroups | None = None) -> None:
        """`prefix_groups` (of the unpadded batch, indices < bs) is used only when the
        graphs capture the cascade path; otherwise decode stays plain."""
        if self._cg is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) first")
        # A capture must record the slot translation: nothing computed earlier.
        self._window_loc = None
        cg = self._cg
        assert bs <= cg["seq_lens"].shape[0], "batch larger than init_cuda_graph_state's max_bs"
        rpi, sl = cg["req_pool_indices"][:bs], cg["seq_lens"][:bs]
        # In-place device copies (no-ops when the caller passes these very buffers).
        if rpi.data_ptr() != req_pool_indices.data_ptr():
            rpi.copy_(req_pool_indices[:bs], non_blocking=True)
        if sl.data_ptr() != seq_lens.data_ptr():
            sl.copy_(seq_lens[:bs], non_blocking=True)
        s = self.num_kv_splits(bs)
        # A graph of one request has no group to share with: it captures plain
        # decode, which saves the cascade pass's launch in every layer.
        cascade = self._cg_cascade if bs > 1 else None
        if cascade is not None and prefix_groups is not self._cg_groups:
            self._write_graph_plan(prefix_groups)
        self._decode = _DecodeMeta(rpi, sl, cg["mid_o"][:bs], cg["mid_lse"][:bs], s, cascade)
        if self.batch_invariant:
            self._decode.invariant = (cg["inv_o"][:bs], cg["inv_m"][:bs], cg["inv_l"][:bs])
            self._decode.programs = self._invariant_programs(bs)

    def _write_graph_plan(self, groups: PrefixGroups | None) -> None:
        """The groups' plan (or none: all zero) into the static tables, whole, so no
        row or item of an earlier plan survives."""
        buf = self._cg_tables_buf
        assert buf is not None
        max_bs = self._cg["seq_lens"].shape[0]
        plan = self._plan(groups)
        if plan is None:
            plan = CascadePlan(0, self.cascade_members, [], [], [], [])  # all zero
        host = plan.pack(max_bs, self.max_cascade_items)
        buf.copy_(host.pin_memory() if buf.is_cuda else host, non_blocking=True)
        self._cg_groups = groups

    # ---- forward -------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: RadixAttention, fb: ForwardBatch, rope: Rope | None = None,
                sums: SplitSums | None = None) -> torch.Tensor:
        """As the base class; RoPE and the K/V store run as one kernel (one launch
        less per layer) where the pool takes plain rows and the rotary covers
        the whole head, and that kernel adds the qkv product's split-K sums
        (`sums`) first: one launch less again."""
        stored = False
        if rope is not None:
            emb, positions = rope
            target = self._store_target(layer, fb, k.dtype)
            # The fused store copies rows as they are: not into an FP8 pool.
            if (target is not None and target[0].dtype == k.dtype
                    and emb.rotary_dim == emb.head_dim
                    and k.shape[0] >= self.kv_store_min_tokens):
                apply_rope_(positions, q, k, emb.head_dim, emb.cos_sin_cache,
                            kv_store=(v, *target), qk_norm=emb.qk_norm, sums=sums)
                stored = True
                sums = None
        if sums is not None:
            sums.finish()
        if rope is not None and not stored:
            q, k = emb(positions, q, k)
        if fb.mode.is_mixed():
            return self.forward_mixed(q, k, v, layer, fb, kv_stored=stored)
        if fb.mode.is_verify():
            return self.forward_verify(q, k, v, layer, fb, kv_stored=stored)
        if fb.mode.is_decode():
            return self.forward_decode(q, k, v, layer, fb, kv_stored=stored)
        return self.forward_extend(q, k, v, layer, fb, kv_stored=stored)

    def _store_target(self, layer: RadixAttention, fb: ForwardBatch, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k buffer, v buffer, rows) a kernel may copy the new K/V rows into, or None
        (then the pool's `set_kv_buffer`); an FP8 pool's buffers hold the FP8
        codes (`_store` quantizes into them). A window pool's layer is written at the
        window slots of the new tokens: one gather per forward, shared by its
        window layers. A CUDA-graph capture must record that gather, so a gather
        made outside the capture (the warm-up runs before it) is not reused in it."""
        pool = fb.token_to_kv_pool
        slot_map = pool.layer_slot_map(layer.layer_id)
        if isinstance(pool, FP8TokenToKVPool) and slot_map is None:
            return (*pool.get_kv_buffer(layer.layer_id), fb.out_cache_loc)
        if slot_map is None:
            bufs = row_kv_buffers(pool, layer.layer_id, dtype)
            return None if bufs is None else (*bufs, fb.out_cache_loc)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if k_buf.dtype != dtype:
            return None
        loc = fb.out_cache_loc
        capturing = loc.is_cuda and torch.cuda.is_current_stream_capturing()
        cached = self._window_loc
        if cached is None or cached[0] is not loc or cached[2] != capturing:
            cached = self._window_loc = (loc, slot_map[loc], capturing)
        return k_buf, v_buf, cached[1]

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
               fb: ForwardBatch) -> None:
        target = self._store_target(layer, fb, k.dtype)
        if target is not None and k.shape[0] >= self.kv_store_min_tokens:
            store_kv(k, v, *target,
                     kv_scales=fb.token_to_kv_pool.layer_scales(layer.layer_id))
        else:
            fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch,
                       kv_stored: bool = False) -> torch.Tensor:
        meta = self._extend
        assert meta is not None, "init_forward_metadata was not called for this extend batch"
        if not kv_stored:
            self._store(k, v, layer, fb)
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        scales = fb.token_to_kv_pool.layer_scales(layer.layer_id)
        n, h, d = q.shape[0], layer.num_heads, layer.head_dim
        qv = q.view(n, h, d)
        o = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
        if self.batch_invariant:
            tiles = meta.tables.get(-1)  # built by the first layer, reused by the rest
            if tiles is None:
                tiles = meta.tables[-1] = build_tiles(
                    meta.prefix_lens_cpu, meta.extend_lens_cpu, h // layer.num_kv_heads,
                    layer.num_kv_heads, q.device)
            invariant_extend_fwd(
                qv, o, k_buf, v_buf, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc, tiles,
                layer.scaling, self.split, window=layer.sliding_window,
                softcap=layer.logit_softcap,
                slot_map=fb.token_to_kv_pool.layer_slot_map(layer.layer_id), kv_scales=scales)
            return o.view(n, h * d)
        cfg = extend_config(d, q.dtype)
        table = meta.tables.get(cfg["block_m"])
        if table is None:
            table = build_extend_block_table(meta.prefix_lens_cpu, meta.extend_lens_cpu,
                                             cfg["block_m"], q.device)
            meta.tables[cfg["block_m"]] = table
        extend_attention_fwd(
            qv, o, k_buf, v_buf, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
            fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc, table,
            layer.scaling, **cfg, window=layer.sliding_window, softcap=layer.logit_softcap,
            slot_map=fb.token_to_kv_pool.layer_slot_map(layer.layer_id), kv_scales=scales)
        return o.view(n, h * d)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch,
                       kv_stored: bool = False) -> torch.Tensor:
        meta = self._decode
        assert meta is not None, "init_forward_metadata was not called for this decode batch"
        if not kv_stored:
            self._store(k, v, layer, fb)
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        scales = fb.token_to_kv_pool.layer_scales(layer.layer_id)
        bs, h, d = q.shape[0], layer.num_heads, layer.head_dim
        o = torch.empty((bs, h, d), dtype=q.dtype, device=q.device)
        if meta.invariant is not None:
            invariant_decode_fwd(
                q.view(bs, h, d), k_buf, v_buf, o, fb.req_to_token_pool.req_to_token,
                meta.req_pool_indices, meta.seq_lens, *meta.invariant, layer.scaling,
                self.split, meta.programs, window=layer.sliding_window,
                softcap=layer.logit_softcap,
                slot_map=fb.token_to_kv_pool.layer_slot_map(layer.layer_id), kv_scales=scales)
            return o.view(bs, h * d)
        c = meta.cascade
        # Window layers decode plainly: they read at most `window` keys per request,
        # and which of a shared prefix's keys are inside differs per request.
        if c is not None and layer.sliding_window is None:
            cascade_decode_fwd(
                q.view(bs, h, d), k_buf, v_buf, o, fb.req_to_token_pool.req_to_token,
                meta.req_pool_indices, meta.seq_lens, meta.mid_o, meta.mid_lse,
                meta.num_splits, layer.scaling, c.tables, c.mid_po, c.mid_plse,
                softcap=layer.logit_softcap, kv_scales=scales)
            return o.view(bs, h * d)
        decode_attention_fwd(
            q.view(bs, h, d), k_buf, v_buf, o, fb.req_to_token_pool.req_to_token,
            meta.req_pool_indices, meta.seq_lens, meta.mid_o, meta.mid_lse, meta.num_splits,
            layer.scaling, window=layer.sliding_window, softcap=layer.logit_softcap,
            slot_map=fb.token_to_kv_pool.layer_slot_map(layer.layer_id), kv_scales=scales)
        return o.view(bs, h * d)
